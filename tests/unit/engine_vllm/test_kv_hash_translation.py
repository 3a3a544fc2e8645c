"""BlockHashTranslator's edge cases, which a real vLLM on CPU does not easily produce (an orphan
block, offload tiers, a LoRA, multimodal keys). The events here have the fields of vLLM 0.32's
`BlockStored` / `BlockRemoved` (vllm/distributed/kv_events.py); the common path, with events from
a real vLLM, is tests/integration/vllm/test_kv_events.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splitserve.block_hashes import block_hashes, salted_key
from splitserve.services.engine_api.kv_events import AllCleared, BlockRemoved, BlockStored, KVEventLog
from splitserve.services.engine_vllm.kv_hash_translation import BlockHashTranslator, lora_key

BS = 4
KEY = b"model|float32|vllm"


@dataclass
class Stored:                     # vLLM's BlockStored, the fields the translator reads
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int = BS
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = 0


@dataclass
class Removed:
    block_hashes: list[Any]
    medium: str | None = "GPU"
    group_idx: int | None = 0


def make() -> tuple[BlockHashTranslator, KVEventLog]:
    log = KVEventLog()
    return BlockHashTranslator(BS, KEY, log), log


def test_a_chain_stored_in_two_events_hashes_as_the_router_hashes_the_prompt():
    t, log = make()
    tokens = list(range(100, 112))
    t.stored(Stored([11, 12], None, tokens[:8]))
    t.stored(Stored([13], 12, tokens[8:]))
    events = log.take_events()
    expected = block_hashes(tokens, BS, KEY)
    assert [e.seq for e in events] == [1, 2]
    assert events[0].block_hashes + events[1].block_hashes == tuple(expected)
    assert events[0].parent_hash is None and events[1].parent_hash == expected[1]
    assert events[1].token_ids == tuple(tokens[8:])


def test_the_salt_of_a_chains_first_block_keys_every_block():
    t, log = make()
    tokens = list(range(8))
    t.stored(Stored([1], None, tokens[:4], extra_keys=[("tenant",)]))
    t.stored(Stored([2], 1, tokens[4:], extra_keys=[None]))
    hashes = [h for e in log.take_events() for h in e.block_hashes]
    assert hashes == block_hashes(tokens, BS, salted_key(KEY, "tenant"))
    assert hashes != block_hashes(tokens, BS, KEY)


def test_a_lora_block_gets_a_key_of_its_own():
    t, log = make()
    t.stored(Stored([1], None, [1, 2, 3, 4], lora_name="sql", extra_keys=[("sql",)]))
    (event,) = log.take_events()
    assert list(event.block_hashes) == block_hashes([1, 2, 3, 4], BS, lora_key(KEY, "sql"))
    assert list(event.block_hashes) != block_hashes([1, 2, 3, 4], BS, KEY)


def test_an_orphan_and_its_descendants_are_dropped_and_their_removal_ignored():
    t, log = make()
    t.stored(Stored([5], 99, [1, 2, 3, 4]))          # parent 99 never stored
    t.stored(Stored([6], 5, [5, 6, 7, 8]))
    t.removed(Removed([5, 6]))
    assert log.take_events() == [] and t.num_dropped_blocks == 2 and len(t) == 0


def test_multimodal_keys_and_odd_block_sizes_are_dropped():
    t, log = make()
    t.stored(Stored([1], None, [1, 2, 3, 4], extra_keys=[(("img-hash", 0),)]))
    t.stored(Stored([2], None, [1, 2], block_size=2))          # a hybrid model's partial entry
    t.stored(Stored([3], None, [1, 2, 3, 4], group_idx=1))      # a second KV cache group
    t.stored(Stored([4], None, [1, 2, 3]))                       # token ids not whole blocks
    assert log.take_events() == [] and t.num_dropped_blocks == 4


def test_offload_tiers_and_a_device_reset():
    t, log = make()
    tokens = list(range(8))
    expected = block_hashes(tokens, BS, KEY)
    t.stored(Stored([1, 2], None, tokens))
    t.stored(Stored([1], None, tokens[:4], medium="CPU"))       # offloaded to host memory
    t.removed(Removed([2]))
    t.all_cleared()                                             # the device pool only: the host copy stays
    events = log.take_events()
    assert [(type(e), e.tier) for e in events] == [(BlockStored, "device"), (BlockStored, "host"),
                                                   (BlockRemoved, "device"), (BlockRemoved, "device")]
    assert events[1].block_hashes == (expected[0],)
    assert events[2].block_hashes == (expected[1],) and events[3].block_hashes == (expected[0],)
    t.stored(Stored([3], 1, [9, 9, 9, 9]))                      # the host copy still parents new blocks
    assert log.take_events()[0].parent_hash == expected[0]
    t.removed(Removed([1], medium="CPU"))
    t.all_cleared()
    assert [type(e) for e in log.take_events()] == [BlockRemoved, AllCleared] and len(t) == 0


def test_a_reset_without_lower_tiers_is_one_all_cleared_and_a_resync_forgets():
    t, log = make()
    t.stored(Stored([1], None, [1, 2, 3, 4]))
    t.all_cleared()
    t.stored(Stored([2], None, [1, 2, 3, 4]))
    t.resync()
    t.stored(Stored([3], 2, [5, 6, 7, 8]))                      # its parent was forgotten
    assert [type(e) for e in log.take_events()] == [BlockStored, AllCleared, BlockStored, AllCleared]
    assert t.num_dropped_blocks == 1


def test_the_table_is_bounded():
    log = KVEventLog()
    t = BlockHashTranslator(BS, KEY, log, capacity=3)
    for i in range(5):
        t.stored(Stored([i], None, [i] * 4))
    assert len(t) == 3 and t.splitserve_hash(0) is None and t.splitserve_hash(4) is not None
