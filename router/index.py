"""The router's KV index: which workers hold which cached blocks (DESIGN section 4).

block hash -> bitmask of the workers holding it (each worker gets one bit while
it holds anything), plus each worker's own set of hashes (for its count and to
clear it). Because block hashes are chained, "how many leading blocks of this
request does each worker hold" is one walk down the request's hash chain,
narrowing the mask of workers still matching with one integer AND per block
(the shape of SGLang's radix tree and Dynamo's indexer, flattened to a hash map
because the chain already encodes the prefix). Only workers with a non-zero
overlap appear in the answer; the rest hold 0 leading blocks.
"""

from __future__ import annotations

from collections.abc import Iterable


STORED, REMOVED, CLEARED = 1, 2, 3      # event kinds for KvIndex.apply


class KvIndex:
    def __init__(self) -> None:
        self._holders: dict[bytes, int] = {}          # block hash -> mask of worker bits
        self._blocks: dict[str, set[bytes]] = {}
        self._bits: dict[str, int] = {}               # worker id -> its bit (1 << position)
        self._names: list[str | None] = []            # position -> worker id
        self._free: list[int] = []                    # released positions, reused first

    # -- worker bits ---------------------------------------------------------------
    def _bit(self, worker_id: str) -> int:
        bit = self._bits.get(worker_id)
        if bit is None:
            if self._free:
                pos = self._free.pop()
                self._names[pos] = worker_id
            else:
                pos = len(self._names)
                self._names.append(worker_id)
            bit = self._bits[worker_id] = 1 << pos
        return bit

    def _release(self, worker_id: str) -> None:
        bit = self._bits.pop(worker_id, None)
        if bit is not None:
            pos = bit.bit_length() - 1
            self._names[pos] = None
            self._free.append(pos)

    # -- updates -------------------------------------------------------------------
    def stored(self, worker_id: str, block_hashes: Iterable[bytes]) -> None:
        bit = self._bit(worker_id)
        mine = self._blocks.get(worker_id)
        if mine is None:
            mine = self._blocks[worker_id] = set()
        holders = self._holders
        get = holders.get
        for h in block_hashes:
            if h not in mine:
                mine.add(h)
                holders[h] = get(h, 0) | bit

    def removed(self, worker_id: str, block_hashes: Iterable[bytes]) -> None:
        mine = self._blocks.get(worker_id)
        if not mine:
            return
        keep = ~self._bits[worker_id]
        holders = self._holders
        for h in block_hashes:
            if h in mine:
                mine.discard(h)
                m = holders[h] & keep
                if m:
                    holders[h] = m
                else:
                    del holders[h]

    def clear_worker(self, worker_id: str) -> None:
        """AllCleared, a snapshot's reset, or a worker leaving routing."""
        mine = self._blocks.pop(worker_id, None)
        if mine:
            keep = ~self._bits[worker_id]
            holders = self._holders
            for h in mine:
                m = holders[h] & keep
                if m:
                    holders[h] = m
                else:
                    del holders[h]
        self._release(worker_id)

    def apply(self, worker_id: str, ops: Iterable[tuple[int, Iterable[bytes]]]) -> None:
        """A run of one worker's events in order: (STORED | REMOVED | CLEARED, block hashes).

        The same as calling stored/removed/clear_worker one by one, with the per-call
        set-up done once (the subscriber's hot path).
        """
        holders = self._holders
        get = holders.get
        bit = self._bit(worker_id)
        keep = ~bit
        mine = self._blocks.get(worker_id)
        if mine is None:
            mine = self._blocks[worker_id] = set()
        for kind, hashes in ops:
            if kind == STORED:
                for h in hashes:
                    if h not in mine:
                        mine.add(h)
                        holders[h] = get(h, 0) | bit
            elif kind == REMOVED:
                for h in hashes:
                    if h in mine:
                        mine.discard(h)
                        m = holders[h] & keep
                        if m:
                            holders[h] = m
                        else:
                            del holders[h]
            elif kind == CLEARED:
                self.clear_worker(worker_id)
                bit = self._bit(worker_id)
                keep = ~bit
                mine = self._blocks[worker_id] = set()

    # -- queries -------------------------------------------------------------------
    def num_blocks(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))

    def workers(self) -> list[str]:
        return [w for w, b in self._blocks.items() if b]

    def holds(self, worker_id: str, block_hash: bytes) -> bool:
        return block_hash in self._blocks.get(worker_id, ())

    def overlaps(self, block_hashes: list[bytes]) -> dict[str, int]:
        """worker id -> number of leading blocks of `block_hashes` it holds (absent: 0)."""
        result: dict[str, int] = {}
        if not block_hashes:
            return result
        get = self._holders.get
        live = get(block_hashes[0], 0)
        depth = 1
        for i in range(1, len(block_hashes)):
            nxt = live & get(block_hashes[i], 0)
            if nxt != live:
                self._name_all(live ^ nxt, depth, result)
                live = nxt
            if not live:
                return result
            depth += 1
        self._name_all(live, depth, result)
        return result

    def _name_all(self, mask: int, depth: int, result: dict[str, int]) -> None:
        names = self._names
        while mask:
            low = mask & -mask
            result[names[low.bit_length() - 1]] = depth
            mask ^= low
