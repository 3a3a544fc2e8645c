"""vLLM's KV cache events in splitserve's block hashes (the pure half of kv_events.py).

vLLM names a cached block by its own hash (SHA-256 of a pickle or CBOR, truncated to 64 bits in
events); splitserve's router, its snapshots and replay know blocks by `splitserve/block_hashes.py`'s
chained SHA-256 with the engine's extra key. A `BlockStored` carries what that needs: the blocks'
token ids and the parent's vLLM hash, whose splitserve hash this translator remembers
(vLLM hash → `_Chain`). So each stored block is hashed once, here, exactly as the router hashes a
prompt, and removals and clears are mapped back through the same table.

What vLLM's hash has that the event may not:
- `cache_salt` is in vLLM's extra keys of a chain's *first* block only (the chain carries it on),
  untagged in the event; splitserve salts every block (`salted_key`). So a first block takes the
  salt from its event's extra keys and its descendants inherit their parent's key: the hashes
  published are the ones the router computes for the salted request.
- A LoRA's blocks hash with the LoRA name in vLLM; they get a key of their own here (the salted key
  plus the name), so they never pose as the base model's blocks. The router hashes no LoRA, so it
  finds no prefix for a LoRA request (it routes it by load).
- Multimodal and prompt-embedding extra keys have no splitserve equivalent: such a block and its
  descendants are not published (the router under-counts them; it never claims a hit that is not
  there).

A block whose parent is unknown (its parent was removed, or its event was lost in a resync) cannot
be hashed: it is dropped and counted, and so are its descendants. vLLM's prefix lookup walks from
the first block, so such a block is unreachable there too until its parent is stored again, and
the router's walk, also from the first block, would not reach it either. Events for a KV cache
group other than the first, or whose token ids are not whole blocks of the engine's block size
(hybrid models' partial entries), are dropped the same way: splitserve hashes one block size.
"""

from __future__ import annotations

import logging
import struct
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from splitserve.block_hashes import hash_block, salted_key
from splitserve.services.engine_api.kv_events import KVEventLog

log = logging.getLogger(__name__)

LORA_MARK = b"\x00lora\x00"
# vLLM's `medium` → splitserve's tier (services/engine_api/kv_events.py); None is the device pool.
TIER_OF_MEDIUM: dict[str | None, str] = {None: "device", "GPU": "device", "CPU": "host", "STORAGE": "disk"}

VllmHash = Hashable        # vLLM's ExternalBlockHash: an int (the default) or bytes


class VllmBlockStored(Protocol):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    medium: str | None
    lora_name: str | None
    extra_keys: list[Sequence[Any] | None] | None
    group_idx: int | None


class VllmBlockRemoved(Protocol):
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None


@dataclass(slots=True)
class _Chain:
    """What a known vLLM block is in splitserve's terms."""

    block_hash: bytes             # splitserve's hash of the block
    key: bytes                    # the extra key its chain hashes with (salted, LoRA'd)
    tiers: set[str] = field(default_factory=set)


def lora_key(key: bytes, lora_name: str) -> bytes:
    name = lora_name.encode()
    return key + LORA_MARK + struct.pack("<I", len(name)) + name


class BlockHashTranslator:
    """Turns vLLM's events into splitserve's, appended to `log` (which numbers them).

    `capacity` bounds the table; blocks leave it when every tier has removed them. Past the bound
    the least recently stored go first (their later removals then cannot be mapped): keep it above
    the engine's blocks in every tier.
    """

    def __init__(self, block_size: int, extra_key: bytes, log: KVEventLog, capacity: int = 1 << 18):
        self.block_size = block_size
        self.extra_key = extra_key
        self.log = log
        self.capacity = capacity
        self._known: OrderedDict[VllmHash, _Chain] = OrderedDict()
        self.num_dropped_blocks = 0          # stored blocks not published (see the module docstring)

    def __len__(self) -> int:
        return len(self._known)

    def splitserve_hash(self, vllm_hash: VllmHash) -> bytes | None:
        chain = self._known.get(vllm_hash)
        return chain.block_hash if chain is not None else None

    # -- events ------------------------------------------------------------------
    def stored(self, event: VllmBlockStored) -> None:
        tier = TIER_OF_MEDIUM.get(event.medium)
        n = len(event.block_hashes)
        if tier is None or event.group_idx not in (None, 0) or event.block_size != self.block_size \
                or len(event.token_ids) != n * self.block_size:
            self._drop(n, "medium %s, group %s, %d tokens for %d blocks of %d", event.medium, event.group_idx,
                       len(event.token_ids), n, event.block_size)
            return
        key = self._first_key(event)
        if key is None:
            return
        first_parent = parent = (self._known[event.parent_block_hash].block_hash
                                 if event.parent_block_hash is not None else None)
        hashes: list[bytes] = []
        for i, vllm_hash in enumerate(event.block_hashes):
            if i > 0 and not _plain(event, i):
                self._drop(n - i, "extra keys %r on block %d", event.extra_keys[i], i)
                break
            tokens = event.token_ids[i * self.block_size:(i + 1) * self.block_size]
            h = hash_block(parent, tokens, key)
            self._remember(vllm_hash, h, key, tier)
            hashes.append(h)
            parent = h
        if hashes:
            self.log.stored(tuple(hashes), first_parent, tuple(event.token_ids[:len(hashes) * self.block_size]),
                            tier)

    def removed(self, event: VllmBlockRemoved) -> None:
        tier = TIER_OF_MEDIUM.get(event.medium)
        if tier is None or event.group_idx not in (None, 0):
            return
        hashes = []
        for vllm_hash in event.block_hashes:
            chain = self._known.get(vllm_hash)
            if chain is None or tier not in chain.tiers:
                continue                      # dropped when stored: the router never heard of it
            chain.tiers.discard(tier)
            if not chain.tiers:
                del self._known[vllm_hash]
            hashes.append(chain.block_hash)
        if hashes:
            self.log.removed(tuple(hashes), tier)

    def all_cleared(self) -> None:
        """vLLM reset its device pool's prefix cache. Blocks in lower tiers (CPU offload) stay, so
        then only the device's blocks are removed; else one AllCleared says it."""
        if all(chain.tiers <= {"device"} for chain in self._known.values()):
            self._known.clear()
            self.log.cleared()
            return
        hashes = []
        for vllm_hash, chain in list(self._known.items()):
            if "device" in chain.tiers:
                chain.tiers.discard("device")
                hashes.append(chain.block_hash)
                if not chain.tiers:
                    del self._known[vllm_hash]
        if hashes:
            self.log.removed(tuple(hashes), "device")

    def resync(self) -> None:
        """Events were lost: nothing known can be trusted. The router hears an AllCleared."""
        self._known.clear()
        self.log.cleared()

    # -- internals ---------------------------------------------------------------
    def _first_key(self, event: VllmBlockStored) -> bytes | None:
        """The key the event's first block hashes with: its parent's, or (a chain's first block)
        the engine's, salted and LoRA'd from the event. None: the event is dropped."""
        if event.parent_block_hash is not None:
            parent = self._known.get(event.parent_block_hash)
            if parent is None:
                self._drop(len(event.block_hashes), "unknown parent %r", event.parent_block_hash)
                return None
            if not _plain(event, 0):
                self._drop(len(event.block_hashes), "extra keys %r", event.extra_keys[0])
                return None
            return parent.key
        keys = list(_extra_keys(event, 0))
        salts = [k for k in keys if isinstance(k, str)]
        if len(salts) != len(keys) or len(salts) > 1:      # multimodal or prompt-embedding keys
            self._drop(len(event.block_hashes), "extra keys %r", keys)
            return None
        key = salted_key(self.extra_key, salts[0] if salts else "")
        return lora_key(key, event.lora_name) if event.lora_name else key

    def _remember(self, vllm_hash: VllmHash, block_hash: bytes, key: bytes, tier: str) -> None:
        chain = self._known.get(vllm_hash)
        if chain is None or chain.block_hash != block_hash:
            chain = self._known[vllm_hash] = _Chain(block_hash, key)
        else:
            self._known.move_to_end(vllm_hash)
        chain.tiers.add(tier)
        while len(self._known) > self.capacity:
            self._known.popitem(last=False)

    def _drop(self, num_blocks: int, why: str, *args: Any) -> None:
        self.num_dropped_blocks += num_blocks
        log.debug("vLLM KV event: %d block(s) not published: " + why, num_blocks, *args)


def _extra_keys(event: VllmBlockStored, i: int) -> Sequence[Any]:
    """Block i's untagged extra keys without its LoRA name (vLLM puts that first when set)."""
    keys = list((event.extra_keys[i] if event.extra_keys and i < len(event.extra_keys) else None) or ())
    if event.lora_name and keys and keys[0] == event.lora_name:
        keys = keys[1:]
    return keys


def _plain(event: VllmBlockStored, i: int) -> bool:
    """Block i (not a chain's first) has no extra keys beyond the LoRA: nothing splitserve cannot hash."""
    return not _extra_keys(event, i)
