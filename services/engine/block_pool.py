"""Block bookkeeping: free list, reference counts, the prefix cache, LRU eviction.

Plain CPU data, no tensors. A block is in exactly one of three states:
  free       on the free list, holds nothing;
  in use     ref_count > 0 (held by one or more running sequences);
  cached     ref_count == 0 but its hash is registered: reusable by a later
             request with the same prefix, evicted least-recently-freed first.
Allocation returns None when there are not enough blocks (the caller preempts
or waits); it never raises for that.
"""

from __future__ import annotations

from collections import OrderedDict

from splitserve.services.engine.kv_events import KVEvent, KVEventLog


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))   # pop() gives 0 first
        self.cached: dict[bytes, int] = {}                # hash -> block id
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with ref 0, LRU first
        self.events = KVEventLog()

    # -- queries -----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free + evictable cached)."""
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def cached_prefix(self, block_hashes: list[bytes]) -> list[int]:
        """Block ids holding the longest cached prefix of this hash chain (no ref taken)."""
        if not self.enable_prefix_caching:
            return []
        ids = []
        for h in block_hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            ids.append(block_id)
        return ids

    # -- changes -----------------------------------------------------------------
    def take_refs(self, block_ids: list[int]) -> None:
        """Hold cached blocks found by `cached_prefix` for a sequence."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                self.evictable.pop(b, None)
            self.ref_counts[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        if n > self.num_free_blocks:
            return None
        ids = []
        for _ in range(n):
            if self.free_ids:
                b = self.free_ids.pop()
            else:
                b, _ = self.evictable.popitem(last=False)
                self._uncache(b)
            self.ref_counts[b] = 1
            ids.append(b)
        return ids

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; the last one frees or parks it as cached.

        Released in reverse so that a sequence's tail blocks are evicted before its head.
        """
        for b in reversed(block_ids):
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0, f"block {b} released twice"
            if self.ref_counts[b] == 0:
                if self.block_hash[b] is not None:
                    self.evictable[b] = None
                else:
                    self.free_ids.append(b)

    def cache_block(self, block_id: int, block_hash: bytes, parent_hash: bytes | None,
                    token_ids: list[int]) -> None:
        """Register a full, computed block under its hash and publish it."""
        if not self.enable_prefix_caching or self.block_hash[block_id] is not None:
            return
        if block_hash in self.cached:
            return   # an identical block computed concurrently stays the cached copy
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id
        self.events.stored((block_hash,), parent_hash, tuple(token_ids))

    def clear_cache(self) -> None:
        """Forget every cached block (e.g. after weights change); one AllCleared event."""
        for b in list(self.evictable):
            self._uncache(b, publish=False)
            self.free_ids.append(b)
        self.evictable.clear()
        for b, h in enumerate(self.block_hash):
            if h is not None:
                self._uncache(b, publish=False)
        self.events.cleared()

    def take_events(self) -> list[KVEvent]:
        return self.events.take_events()

    def _uncache(self, block_id: int, publish: bool = True) -> None:
        h = self.block_hash[block_id]
        if h is None:
            return
        self.block_hash[block_id] = None
        del self.cached[h]
        if publish:
            self.events.removed((h,))
