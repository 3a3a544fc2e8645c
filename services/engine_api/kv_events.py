"""KV cache events: what a worker tells routers about its prefix cache.

Every change to the set of cached blocks becomes one event with a per-engine
sequence number, so a subscriber that missed some can tell (a gap) and resync.
Block hashes are the chained SHA-256 digests of `splitserve/block_hashes.py`. `tier` says where the
block is: "device" (the engine's pool), "host" or "disk" (kv_tiers/), or "store" (the shared
block store: what it took from this engine or evicted for it; an empty BlockStored says the
engine attached to it).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class BlockStored:
    seq: int
    block_hashes: tuple[bytes, ...]
    parent_hash: bytes | None
    token_ids: tuple[int, ...] = ()
    tier: str = "device"


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    seq: int
    block_hashes: tuple[bytes, ...]
    tier: str = "device"


@dataclass(slots=True, frozen=True)
class AllCleared:
    seq: int


KVEvent = BlockStored | BlockRemoved | AllCleared


@dataclass(slots=True)
class KVEventLog:
    """Numbers events and queues them until a publisher takes them (`take_events`)."""

    next_seq: int = 1
    pending: list[KVEvent] = field(default_factory=list)

    def stored(self, block_hashes: tuple[bytes, ...], parent_hash: bytes | None,
               token_ids: tuple[int, ...], tier: str = "device") -> None:
        self.pending.append(BlockStored(self._bump(), block_hashes, parent_hash, token_ids, tier))

    def removed(self, block_hashes: tuple[bytes, ...], tier: str = "device") -> None:
        self.pending.append(BlockRemoved(self._bump(), block_hashes, tier))

    def cleared(self) -> None:
        self.pending.append(AllCleared(self._bump()))

    def take_events(self) -> list[KVEvent]:
        events, self.pending = self.pending, []
        return events

    def _bump(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq
