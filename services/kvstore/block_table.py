"""Which store slot holds which block: content hashes, checksums, LRU, pins and pending writes.

Plain CPU bookkeeping over the store's pool of `capacity` slots (the bytes live in the pool
tensor, server.py). A slot is in one of four states:

- free;
- pending: granted to a publisher's write, not yet served (`reserve` → `commit` or `abort`);
- held: a committed block, in LRU order, served by `lookup` and `pin`;
- pinned: held and being written to a fetcher; never evicted while pinned.

`reserve` takes free slots first, then evicts the least recently used held blocks that no
fetch pins; a hash that is held or pending is not wanted again (one copy per hash).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Reserved:
    wanted: list[int]          # indices into the offer
    slots: list[int]           # one slot per wanted index
    evicted: list[bytes]       # hashes dropped to make room


class StoreBlockTable:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._held: OrderedDict[bytes, int] = OrderedDict()     # hash → slot, least recently used first
        self._crc: dict[int, int] = {}                          # held slot → CRC-32 as published
        self._pending: dict[bytes, int] = {}                    # hash → slot being written
        self._pins: Counter = Counter()                         # slot → fetches reading it

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._held

    def lookup(self, hashes: list[bytes]) -> int:
        """Leading hashes held; each one found counts as a use."""
        n = 0
        for h in hashes:
            if h not in self._held:
                break
            self._held.move_to_end(h)
            n += 1
        return n

    def reserve(self, hashes: list[bytes]) -> Reserved:
        wanted, slots, evicted = [], [], []
        for i, h in enumerate(hashes):
            if h in self._held or h in self._pending or h in hashes[:i]:
                continue
            slot = self._take_slot(evicted)
            if slot is None:
                break                    # every slot is pending or pinned: offer the rest later
            self._pending[h] = slot
            wanted.append(i)
            slots.append(slot)
        return Reserved(wanted, slots, evicted)

    def _take_slot(self, evicted: list[bytes]) -> int | None:
        if self._free:
            return self._free.pop()
        for h, slot in self._held.items():
            if not self._pins[slot]:
                del self._held[h]
                self._crc.pop(slot, None)
                evicted.append(h)
                return slot
        return None

    def commit(self, block_hash: bytes, crc: int) -> None:
        slot = self._pending.pop(block_hash)
        self._held[block_hash] = slot
        self._crc[slot] = crc

    def abort(self, block_hash: bytes) -> None:
        slot = self._pending.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def pending_slot(self, block_hash: bytes) -> int | None:
        return self._pending.get(block_hash)

    def pin(self, hashes: list[bytes]) -> list[tuple[int, int]]:
        """(slot, crc) of the leading held hashes, pinned until `unpin`."""
        out = []
        for h in hashes:
            slot = self._held.get(h)
            if slot is None:
                break
            self._held.move_to_end(h)
            self._pins[slot] += 1
            out.append((slot, self._crc[slot]))
        return out

    def unpin(self, slots: list[int]) -> None:
        for slot in slots:
            self._pins[slot] -= 1
            if self._pins[slot] <= 0:
                del self._pins[slot]

    @property
    def num_pending(self) -> int:
        return len(self._pending)
