"""Block bookkeeping: free runs, reference counts, the prefix cache, near-LRU eviction.

Plain CPU data, no tensors. A block is in exactly one of three states:
  free       in a run of free ids (`FreeRuns`), holds nothing;
  in use     ref_count > 0 (held by one or more running sequences);
  cached     ref_count == 0 but its hash is registered: reusable by a later
             request with the same prefix, evicted (nearly) least-recently-freed first.
Allocation returns None when there are not enough blocks (the caller preempts
or waits); it never raises for that.

Contiguous allocation: a KV transfer moves each run of consecutive block ids as
one span (kvtransfer/tp_slicing.py), so a request should get long runs on both
the prefill and the decode side. Free blocks are kept as maximal runs of
consecutive ids; `allocate` takes free blocks before evicting cached ones and
among free runs continues the caller's last block when it can (`after`), then
takes the smallest run that holds the rest (best fit), else the largest runs
first. Eviction of k blocks looks at the 2k + EVICTION_SLACK least recently
freed and takes runs of consecutive ids among them the same way, each from its
end (a sequence's tail was freed before its head): the LRU order bends only that
far. The blocks of one allocation come out in ascending order, so the cached
full blocks and the free partial tail that a sequence left behind come back as
the run they were."""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from collections.abc import Callable

from splitserve.services.engine_api.kv_events import KVEvent, KVEventLog

EVICTION_SLACK = 16      # cached blocks beyond the strict LRU ones that eviction may pick to form runs


class FreeRuns:
    """Free block ids as maximal runs of consecutive ids, indexed by start, end and length."""

    def __init__(self, num_blocks: int):
        self._len_at: dict[int, int] = {}                  # run start -> length
        self._start_at: dict[int, int] = {}                # run end (exclusive) -> start
        self._by_len: dict[int, dict[int, None]] = {}     # length -> run starts (insertion-ordered)
        self._lengths: list[int] = []                      # distinct lengths, ascending
        self.count = 0
        if num_blocks:
            self._insert(0, num_blocks)
            self.count = num_blocks

    def __len__(self) -> int:
        return self.count

    def runs(self) -> list[tuple[int, int]]:
        """(start, length) of every run, ascending by start."""
        return sorted(self._len_at.items())

    def add(self, block_id: int) -> None:
        """Free one block, merging it with the runs it touches."""
        start, end = block_id, block_id + 1
        left = self._start_at.get(start)
        if left is not None:
            self._remove(left)
            start = left
        right = self._len_at.get(end)
        if right is not None:
            self._remove(end)
            end += right
        self._insert(start, end - start)
        self.count += 1

    def take(self, n: int, after: int | None = None) -> list[int]:
        """`n` ids (n <= len(self)) in few runs: the run right after `after` first, then the
        smallest run that holds the rest, else the largest; each from its start."""
        ids: list[int] = []
        if n and after is not None and after + 1 in self._len_at:
            ids += self._take_from(after + 1, n)
        while len(ids) < n:
            need = n - len(ids)
            i = bisect.bisect_left(self._lengths, need)
            length = self._lengths[i] if i < len(self._lengths) else self._lengths[-1]
            ids += self._take_from(next(iter(self._by_len[length])), need)
        return ids

    def _take_from(self, start: int, n: int) -> list[int]:
        length = self._remove(start)
        k = min(n, length)
        if k < length:
            self._insert(start + k, length - k)
        self.count -= k
        return list(range(start, start + k))

    def _insert(self, start: int, length: int) -> None:
        self._len_at[start] = length
        self._start_at[start + length] = start
        starts = self._by_len.get(length)
        if starts is None:
            starts = self._by_len[length] = {}
            bisect.insort(self._lengths, length)
        starts[start] = None

    def _remove(self, start: int) -> int:
        length = self._len_at.pop(start)
        del self._start_at[start + length]
        starts = self._by_len[length]
        del starts[start]
        if not starts:
            del self._by_len[length]
            del self._lengths[bisect.bisect_left(self._lengths, length)]
        return length


class BlockPool:
    """Every block's state (module docstring): free runs, reference counts, cached hashes, eviction order."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free = FreeRuns(num_blocks)
        self.cached: dict[bytes, int] = {}                # hash -> block id
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with ref 0, LRU first
        self.events = KVEventLog()
        # Called with (block id, hash) of cached blocks about to be reused, before they are:
        # the engine's lower tiers copy them out (kv_tiers/tiers.py).
        self.on_evict: Callable[[list[tuple[int, bytes]]], None] | None = None
        self.on_cached: Callable[[int, bytes], None] | None = None    # a block newly registered (publishing)

    # -- queries -----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free + evictable cached)."""
        return len(self.free) + len(self.evictable)

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

    def allocate(self, n: int, after: int | None = None) -> list[int] | None:
        """`n` blocks with one reference each: free ones first, then evicted cached ones (`_evict`).

        `after`: the caller's last block, which the new ones continue where it is free after it.
        """
        if n > self.num_free_blocks:
            return None
        ids = self.free.take(min(n, len(self.free)), after)
        if len(ids) < n:
            # A finished sequence left its partial tail block free and its full blocks cached:
            # sorted together they come back as the runs they were.
            ids = sorted(ids + self._evict(n - len(ids)))
        for b in ids:
            self.ref_counts[b] = 1
        return ids

    def _evict(self, k: int) -> list[int]:
        """Uncache `k` blocks for reuse: among the `2k + EVICTION_SLACK` least recently freed, runs of
        consecutive ids best fit first, each from its end (a sequence's tail was freed first)."""
        runs: list[list[int]] = []                   # [start, length], ascending start
        for b in sorted(itertools.islice(self.evictable, 2 * k + EVICTION_SLACK)):
            if runs and runs[-1][0] + runs[-1][1] == b:
                runs[-1][1] += 1
            else:
                runs.append([b, 1])
        runs.sort(key=lambda run: run[1])
        lengths = [length for _, length in runs]
        ids: list[int] = []
        while len(ids) < k:
            need = k - len(ids)
            i = min(bisect.bisect_left(lengths, need), len(runs) - 1)
            start, length = runs.pop(i)
            del lengths[i]
            ids += range(start + length - min(need, length), start + length)
        if self.on_evict is not None:
            self.on_evict([(b, self.block_hash[b]) for b in ids])
        for b in ids:
            del self.evictable[b]
            self._uncache(b)
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
                    self.free.add(b)

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
        if self.on_cached is not None:
            self.on_cached(block_id, block_hash)

    def clear_cache(self) -> None:
        """Forget every cached block (e.g. after weights change); one AllCleared event."""
        for b in list(self.evictable):
            self._uncache(b, publish=False)
            self.free.add(b)
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
