"""BlockPool bookkeeping and its KV events, against a brute-force model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.router.hashing import block_hashes, hash_block
from splitserve.services.engine.block_pool import BlockPool
from splitserve.services.engine.kv_events import AllCleared, BlockRemoved, BlockStored


def test_allocate_until_empty_then_none():
    pool = BlockPool(4, 16)
    ids = pool.allocate(3)
    assert sorted(ids) == [0, 1, 2] and pool.num_free_blocks == 1
    assert pool.allocate(2) is None and pool.num_free_blocks == 1   # nothing taken on failure
    pool.release(ids)
    assert pool.num_free_blocks == 4


def test_cached_blocks_are_reused_then_evicted_lru():
    pool = BlockPool(3, 2)
    a, b = pool.allocate(2)
    ha, hb = hash_block(None, [1, 2]), hash_block(hash_block(None, [1, 2]), [3, 4])
    pool.cache_block(a, ha, None, [1, 2])
    pool.cache_block(b, hb, ha, [3, 4])
    pool.release([a, b])                       # tail released first: b is older in LRU
    assert pool.num_free_blocks == 3
    assert pool.cached_prefix([ha, hb]) == [a, b]
    [c] = pool.allocate(1)                     # the never-used free block goes first
    assert c not in (a, b)
    [d] = pool.allocate(1)                     # then the least recently freed cached block
    assert d == b and pool.cached_prefix([ha, hb]) == [a]
    events = pool.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockRemoved]
    assert events[2].block_hashes == (hb,)


def test_take_refs_protects_cached_blocks_from_eviction():
    pool = BlockPool(2, 2)
    [a] = pool.allocate(1)
    h = hash_block(None, [5, 6])
    pool.cache_block(a, h, None, [5, 6])
    pool.release([a])
    pool.take_refs([a])
    assert pool.allocate(2) is None
    pool.release([a])
    assert pool.num_free_blocks == 2


def test_chained_hashes_identify_the_prefix():
    tokens = list(range(40))
    hashes = block_hashes(tokens, 16)
    assert len(hashes) == 2
    assert block_hashes([99] + tokens[1:], 16)[1] != hashes[1]   # block 1 depends on block 0
    assert block_hashes(tokens, 16, extra_key=b"lora") != hashes
    assert block_hashes(tokens, 16, start=hashes[:1]) == hashes


ops = st.lists(st.tuples(st.sampled_from(["alloc", "cache", "release", "hit", "clear"]),
                         st.integers(0, 10 ** 6)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_events_and_counts_agree_with_a_reference(operations):
    pool = BlockPool(8, 4)
    held: list[list[int]] = []
    mirror: set[bytes] = set()
    for op, r in operations:
        if op == "alloc":
            ids = pool.allocate(1 + r % 3)
            if ids is not None:
                held.append(ids)
        elif op == "cache" and held:
            ids = held[r % len(held)]
            parent = None
            for i, b in enumerate(ids):
                h = hash_block(parent, [r % 5, i])
                pool.cache_block(b, h, parent, [r % 5, i])
                parent = h
        elif op == "release" and held:
            pool.release(held.pop(r % len(held)))
        elif op == "hit":
            chain = block_hashes([r % 5, 0, r % 5, 1], 2)
            hits = pool.cached_prefix(chain)
            pool.take_refs(hits)
            if hits:
                held.append(hits)
        elif op == "clear":
            pool.clear_cache()
        for e in pool.take_events():
            if isinstance(e, BlockStored):
                mirror.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                mirror.difference_update(e.block_hashes)
            elif isinstance(e, AllCleared):
                mirror.clear()
        assert mirror == set(pool.cached)
        in_use = {b for ids in held for b in ids}
        assert pool.num_used_blocks == len(in_use)
        assert all((pool.ref_counts[b] > 0) == (b in in_use) for b in range(8))
    for ids in held:
        pool.release(ids)
    assert pool.num_free_blocks == 8 and not any(pool.ref_counts)
