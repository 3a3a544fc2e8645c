"""The tiers below one engine's pool, as the scheduler sees them: write down, look up, load back.

Write-down: when the block pool evicts cached full blocks to reuse them, `write_down` copies
each one (every layer, K and V) into the host tier before the pool hands the block out again;
the host tier's own LRU victims go to the disk tier, whose writes happen behind the engine.
Load: for a prompt whose next blocks (after the device hits) are in a lower tier, `load`
copies them into blocks the scheduler just allocated, verifying each; the first block that
fails (corrupt, truncated, foreign, unreadable) ends the run, and it and everything after it
are recomputed. Tiers are inclusive: a block loaded back stays in its tier too.

Every change is a KV event with its tier (BlockStored/BlockRemoved{tier}), so the router's
index knows what each worker holds where.

The shared store (shared_store.py), when the worker attached one, is the tier below disk:
`lookup` asks it for the blocks after the local run (and keeps them only when `FetchRule`
says fetching beats recomputing), `load` fetches them, and every block the engine computes
is published to it after the step (`note_cached`, `after_step`).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from splitserve.services.engine.kv_cache import KVCache
from splitserve.services.engine_api.kv_events import KVEventLog
from splitserve.kvtransfer.block_codec import BlockRejected, as_bytes
from splitserve.services.engine.kv_tiers.disk_tier import DiskTier
from splitserve.services.engine.kv_tiers.host_tier import HostTier
from splitserve.services.engine.kv_tiers.shared_store import FetchRule, SharedStore

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class TierConfig:
    host_gib: float = 0.0
    disk_gib: float = 0.0
    disk_path: str | None = None

    @property
    def enabled(self) -> bool:
        return self.host_gib > 0 or (self.disk_gib > 0 and bool(self.disk_path))


@dataclass(slots=True)
class TierStats:
    hits: Counter = field(default_factory=Counter)            # tier -> blocks loaded back
    bytes_loaded: Counter = field(default_factory=Counter)    # tier -> bytes
    load_seconds: Counter = field(default_factory=Counter)    # tier -> seconds spent loading
    written_down: Counter = field(default_factory=Counter)    # tier -> blocks stored (store: published)
    evicted: Counter = field(default_factory=Counter)         # tier -> blocks evicted from it
    rejected: Counter = field(default_factory=Counter)        # reason -> blocks dropped on load


class KVTiers:
    def __init__(self, kv: KVCache, layout: bytes, config: TierConfig, events: KVEventLog):
        self.kv = kv
        self.events = events
        self.block_shape = (kv.tensor.shape[0], 2, *kv.tensor.shape[3:])     # [layers, 2, bs, kv_heads, d]
        dtype = kv.tensor.dtype
        self.block_bytes = kv.tensor[:, :, 0].numel() * kv.tensor.element_size()
        on_cuda = kv.tensor.device.type == "cuda"
        self.host = HostTier(int(config.host_gib * GIB) // self.block_bytes, self.block_shape, dtype,
                             pin_memory=on_cuda)
        self.disk = (DiskTier(config.disk_path, int(config.disk_gib * GIB), layout, self.block_bytes)
                     if config.disk_gib > 0 and config.disk_path else None)
        self.stats = TierStats()
        # Blocks the scheduler found below and is about to load: the write-down that the same
        # admission's allocation causes must not push them out first.
        self._loading: frozenset[bytes] = frozenset()
        self.store: SharedStore | None = None
        self.rule = FetchRule(kv.tensor.shape[3])
        self._store_from: int | None = None      # where the last protected lookup's store run begins
        self._new_blocks: list[tuple[int, bytes]] = []    # computed this step: published after it
        self._loaded_now: set[bytes] = set()              # came from a tier this step: not published

    def attach_store(self, store: SharedStore) -> None:
        self.store = store

    # -- down ----------------------------------------------------------------------
    def write_down(self, blocks: list[tuple[int, bytes]]) -> None:
        """Device blocks (id, hash) the pool is about to reuse: keep their contents below."""
        if not blocks:
            return
        self._collect_dropped()
        for block_id, block_hash in blocks:
            block = self.kv.tensor[:, :, block_id]                  # [layers, 2, bs, kv_heads, d], strided
            if self.host.capacity:
                fresh = block_hash not in self.host
                for old_hash, payload in self.host.put(block_hash, block, self._loading):
                    self.events.removed((old_hash,), tier="host")
                    self.stats.evicted["host"] += 1
                    self._to_disk(old_hash, payload)
                if block_hash in self.host:
                    if fresh:
                        self.events.stored((block_hash,), None, (), tier="host")
                        self.stats.written_down["host"] += 1
                    continue
            # No host tier, or every host slot holds a block about to be loaded: straight to disk.
            if self.disk is not None:
                self._to_disk(block_hash, bytes(as_bytes(block.contiguous().cpu())))

    def _to_disk(self, block_hash: bytes, payload: bytes) -> None:
        if self.disk is None:
            return
        fresh = block_hash not in self.disk
        for old in self.disk.put(block_hash, payload, self._loading):
            self.events.removed((old,), tier="disk")
            self.stats.evicted["disk"] += 1
        if fresh and block_hash in self.disk:
            self.events.stored((block_hash,), None, (), tier="disk")
            self.stats.written_down["disk"] += 1

    def _collect_dropped(self) -> None:
        if self.disk is not None:
            dropped = self.disk.take_dropped()
            if dropped:
                self.events.removed(tuple(dropped), tier="disk")

    # -- up ------------------------------------------------------------------------
    def lookup(self, block_hashes: list[bytes], protect: bool = False) -> int:
        """How many of these leading hashes a lower tier holds (no I/O). With `protect` (an
        admission about to load them) they stay out of the tiers' eviction until `load`."""
        n = 0
        for h in block_hashes:
            if h not in self.host and (self.disk is None or h not in self.disk):
                break
            n += 1
        local = n
        if self.store is not None and n < len(block_hashes):
            held = self.store.lookup(block_hashes[n:])
            self.rule.rtt_s = self.store.round_trip_s
            if self.rule.should_fetch(held):
                n += held
        if protect:
            self._loading = frozenset(block_hashes[:local])
            self._store_from = local if n > local else None
        return n

    def load(self, block_hashes: list[bytes], block_ids: list[int]) -> int:
        """Copy these blocks into the device blocks `block_ids`, in order, verifying each; the
        number loaded (the run stops at the first block that is missing or fails)."""
        self._collect_dropped()
        self._loading = frozenset()
        store_from, self._store_from = self._store_from, None
        loaded = 0
        for block_hash, block_id in zip(block_hashes, block_ids):
            if store_from is not None and loaded >= store_from:
                return loaded + self._fetch(block_hashes[loaded:], block_ids[loaded:])
            start = time.perf_counter()
            tier, block = self._read(block_hash)
            if block is None:
                break
            self._loaded_now.add(block_hash)
            self.kv.tensor[:, :, block_id].copy_(block)      # blocking: the host slot may be reused next
            self.stats.hits[tier] += 1
            self.stats.bytes_loaded[tier] += self.block_bytes
            self.stats.load_seconds[tier] += time.perf_counter() - start
            loaded += 1
        return loaded

    def _fetch(self, block_hashes: list[bytes], block_ids: list[int]) -> int:
        start = time.perf_counter()
        n = self.store.fetch(block_hashes, block_ids, self.kv.tensor)
        seconds = time.perf_counter() - start
        if n:
            self.rule.observe_fetch(n, seconds)
            self.stats.hits["store"] += n
            self.stats.bytes_loaded["store"] += n * self.block_bytes
            self.stats.load_seconds["store"] += seconds
            self._loaded_now.update(block_hashes[:n])
        return n

    # -- publishing to the store -------------------------------------------------------
    def note_cached(self, block_id: int, block_hash: bytes) -> None:
        """The pool registered a block (BlockPool.on_cached): publish it after the step if it was computed."""
        if self.store is not None and block_hash not in self._loaded_now:
            self._new_blocks.append((block_id, block_hash))

    def after_step(self, prompt_tokens: int, seconds: float) -> None:
        """End of an engine step: refine the fetch rule, publish the blocks it computed."""
        self._loaded_now.clear()
        if self.store is None:
            return
        self.rule.observe_prefill(prompt_tokens, seconds)
        self.take_store_events()
        if self._new_blocks:
            blocks, self._new_blocks = self._new_blocks, []
            self.store.publish(self.kv.tensor, blocks)
            self.stats.written_down["store"] += len(blocks)

    def take_store_events(self) -> None:
        """The store's events since the last call, as this engine's KV events (tier "store")."""
        if self.store is None:
            return
        for kind, hashes in self.store.take_events():
            if kind == "stored":
                self.events.stored(hashes, None, (), tier="store")
            else:
                self.events.removed(hashes, tier="store")

    def _read(self, block_hash: bytes) -> tuple[str, torch.Tensor | None]:
        try:
            block = self.host.get(block_hash)
            if block is not None:
                return "host", block
        except BlockRejected as exc:
            self.stats.rejected[exc.reason] += 1
            self.events.removed((block_hash,), tier="host")
        if self.disk is None:
            return "disk", None
        try:
            payload = self.disk.get(block_hash)
        except BlockRejected as exc:
            self.stats.rejected[exc.reason] += 1
            self.events.removed((block_hash,), tier="disk")
            return "disk", None
        if payload is None:
            return "disk", None
        block = torch.frombuffer(bytearray(payload), dtype=self.kv.tensor.dtype).view(self.block_shape)
        return "disk", block

    # -- all -----------------------------------------------------------------------
    def occupancy(self) -> dict[str, tuple[int, int]]:
        """tier -> (blocks held, capacity in blocks), for the tiers this engine has."""
        out = {}
        if self.host.capacity:
            out["host"] = (len(self.host), self.host.capacity)
        if self.disk is not None:
            out["disk"] = (len(self.disk), self.disk.capacity_blocks)
        if self.store is not None:
            out["store"] = self.store.occupancy       # shared: what the store held at the last lookup
        return out

    def rejections(self) -> Counter:
        """reason -> blocks dropped: on load (corrupt, truncated, ...), on the disk tier's writes, and by
        the store client (store_unavailable, store_corrupt, ...)."""
        out = self.stats.rejected + (self.disk.write_failures if self.disk is not None else Counter())
        if self.store is not None:
            out.update(self.store.rejections())
        return out

    def clear(self) -> None:
        """Forget every block (the weights changed); the pool's AllCleared covers the events."""
        self.host.clear()
        if self.disk is not None:
            self.disk.clear()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
        if self.store is not None:
            self.store.close()
