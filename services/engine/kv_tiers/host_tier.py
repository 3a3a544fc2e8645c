"""The host-memory tier: a capacity-bounded LRU of whole KV blocks (every layer, K and V).

On CPU the device pool is already DRAM; this is a second, separate pool that holds what the
first evicted, so its size is what `--kv-host-gib` adds. On CUDA the slots are pinned, so
loads back to the GPU are DMA copies. Each slot keeps the checksum (xxh3-64) taken when the block came in,
checked again when it goes out (memory corruption or a bug in slot bookkeeping would otherwise
be a wrong token). The fault switch (kvtransfer/faults.py, site `host`) flips a bit of a slot
after its checksum was taken.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from splitserve.kvtransfer.block_codec import BlockRejected, as_bytes, checksum
from splitserve.kvtransfer.faults import FaultSwitch


@dataclass(slots=True)
class HostEntry:
    slot: int
    crc: int


class HostTier:
    name = "host"

    def __init__(self, capacity_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 pin_memory: bool = False, faults: FaultSwitch | None = None):
        self.capacity = capacity_blocks
        self.faults = faults if faults is not None else FaultSwitch.from_env()
        self.slots = torch.empty((capacity_blocks, *block_shape), dtype=dtype, pin_memory=pin_memory)
        self.block_bytes = self.slots[0].numel() * self.slots.element_size() if capacity_blocks else 0
        self.entries: OrderedDict[bytes, HostEntry] = OrderedDict()       # LRU first
        self.free_slots = list(range(capacity_blocks - 1, -1, -1))

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def put(self, block_hash: bytes, block: torch.Tensor,
            keep: frozenset[bytes] = frozenset()) -> list[tuple[bytes, bytes]]:
        """Keep a copy of `block`; returns the blocks evicted to make room, as (hash, payload bytes).
        The least recently used block goes first, except those in `keep` (about to be loaded);
        if only those are left, `block` itself is not kept."""
        if not self.capacity:
            return []
        entry = self.entries.get(block_hash)
        if entry is not None:
            self.entries.move_to_end(block_hash)
            return []
        evicted = []
        if not self.free_slots:
            victim = next((h for h in self.entries if h not in keep), None)
            if victim is None:
                return []
            old = self.entries.pop(victim)
            evicted.append((victim, bytes(as_bytes(self.slots[old.slot]))))
            self.free_slots.append(old.slot)
        slot = self.free_slots.pop()
        self.slots[slot].copy_(block)
        self.entries[block_hash] = HostEntry(slot, checksum(as_bytes(self.slots[slot])))
        self.faults.flip("host", as_bytes(self.slots[slot]), f"host block {block_hash.hex()[:12]}")
        return evicted

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        """The block (a view of its slot, valid until the next `put`), or None; raises BlockRejected
        (and forgets the block) if its bytes no longer match their checksum."""
        entry = self.entries.get(block_hash)
        if entry is None:
            return None
        if checksum(as_bytes(self.slots[entry.slot])) != entry.crc:
            self.discard(block_hash)
            raise BlockRejected("corrupt", f"host block {block_hash.hex()[:12]} changed since it was stored")
        self.entries.move_to_end(block_hash)
        return self.slots[entry.slot]

    def discard(self, block_hash: bytes) -> bool:
        entry = self.entries.pop(block_hash, None)
        if entry is None:
            return False
        self.free_slots.append(entry.slot)
        return True

    def clear(self) -> list[bytes]:
        hashes = list(self.entries)
        self.entries.clear()
        self.free_slots = list(range(self.capacity - 1, -1, -1))
        return hashes
