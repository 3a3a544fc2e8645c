"""The router's KV index: which workers hold which cached blocks (DESIGN section 4).

block hash -> set of worker ids, plus each worker's own set of hashes (for its
count and to clear it). Because block hashes are chained, "how many leading
blocks of this request does each worker hold" is one walk down the request's
hash chain, narrowing the set of workers still matching (the shape of SGLang's
radix tree and Dynamo's indexer, flattened to a hash map because the chain
already encodes the prefix).
"""

from __future__ import annotations

from collections.abc import Iterable


class KvIndex:
    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}
        self._blocks: dict[str, set[bytes]] = {}

    # -- updates -------------------------------------------------------------------
    def stored(self, worker_id: str, block_hashes: Iterable[bytes]) -> None:
        mine = self._blocks.setdefault(worker_id, set())
        holders = self._holders
        for h in block_hashes:
            if h in mine:
                continue
            mine.add(h)
            s = holders.get(h)
            if s is None:
                holders[h] = {worker_id}
            else:
                s.add(worker_id)

    def removed(self, worker_id: str, block_hashes: Iterable[bytes]) -> None:
        mine = self._blocks.get(worker_id)
        if not mine:
            return
        for h in block_hashes:
            if h in mine:
                mine.discard(h)
                s = self._holders[h]
                s.discard(worker_id)
                if not s:
                    del self._holders[h]

    def clear_worker(self, worker_id: str) -> None:
        """AllCleared, a snapshot's reset, or a worker leaving routing."""
        mine = self._blocks.pop(worker_id, None)
        if mine:
            self._drop(worker_id, mine)

    def _drop(self, worker_id: str, hashes: set[bytes]) -> None:
        for h in hashes:
            s = self._holders[h]
            s.discard(worker_id)
            if not s:
                del self._holders[h]

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
        first = self._holders.get(block_hashes[0])
        if not first:
            return result
        live = set(first)
        depth = 1
        holders = self._holders
        for h in block_hashes[1:]:
            s = holders.get(h)
            nxt = live & s if s else set()
            if len(nxt) != len(live):
                for w in live - nxt:
                    result[w] = depth
            live = nxt
            if not live:
                return result
            depth += 1
        for w in live:
            result[w] = depth
        return result
