"""BlockPool bookkeeping, its KV events and its contiguous allocation, against brute-force models."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.block_hashes import block_hashes, hash_block
from splitserve.services.engine.block_pool import EVICTION_SLACK, BlockPool, FreeRuns
from splitserve.services.engine_api.kv_events import AllCleared, BlockRemoved, BlockStored


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


def is_run(ids: list[int]) -> bool:
    return ids == list(range(ids[0], ids[0] + len(ids)))


def test_free_blocks_come_out_as_runs_best_fit_first():
    pool = BlockPool(32, 4, enable_prefix_caching=False)
    assert pool.allocate(8) == list(range(8))
    a, b, c, _ = pool.allocate(3), pool.allocate(5), pool.allocate(2), pool.allocate(1)   # 8.., 11.., 16.., 18
    pool.release(a)
    pool.release(c)
    assert pool.free.runs() == [(8, 3), (16, 2), (19, 13)]
    assert pool.allocate(2) == [16, 17]          # the run that fits exactly, not the big one
    assert pool.allocate(3) == [8, 9, 10]
    pool.release(b)
    assert pool.free.runs() == [(11, 5), (19, 13)]
    assert pool.allocate(7) == list(range(19, 26))
    assert pool.allocate(6) == list(range(26, 32))   # fits 26..31 exactly, leaves 11..15 whole


def test_allocate_continues_after_the_callers_last_block():
    pool = BlockPool(16, 4, enable_prefix_caching=False)
    first = pool.allocate(3)
    other = pool.allocate(1)
    pool.release(other)                           # 3 is free again, right after `first`
    assert pool.allocate(2, after=first[-1]) == [3, 4]
    assert pool.allocate(2, after=15) == [5, 6]   # nothing free after 15: best fit


def test_when_no_run_fits_the_largest_runs_go_first():
    free = FreeRuns(0)
    for b in [0, 1, 5, 6, 7, 10, 20, 21, 22, 23]:
        free.add(b)
    assert free.runs() == [(0, 2), (5, 3), (10, 1), (20, 4)]
    assert free.take(6) == [20, 21, 22, 23, 0, 1]   # largest whole, then the one that fits the rest
    assert len(free) == 4


def test_evicted_blocks_come_back_in_ascending_order():
    pool = BlockPool(4, 2)
    ids = pool.allocate(4)
    parent = None
    for i, b in enumerate(ids):
        h = hash_block(parent, [i, i])
        pool.cache_block(b, h, parent, [i, i])
        parent = h
    pool.release(ids)                             # tail first: LRU order 3, 2, 1, 0
    assert list(pool.evictable) == [3, 2, 1, 0]
    assert pool.allocate(3) == [1, 2, 3]          # the three least recent, as one run


def test_eviction_takes_a_run_among_the_least_recently_freed():
    pool = BlockPool(64, 2)
    ids = pool.allocate(64)
    for b in ids:
        pool.cache_block(b, hash_block(None, [b, b]), None, [b, b])
    lonely = list(range(30, 64, 2))                      # 17 blocks with no free neighbour yet
    first = [10, 3, 4, 5, 20] + lonely
    for b in first + [b for b in range(64) if b not in first]:
        pool.release([b])
    assert pool.allocate(3) == [3, 4, 5]                 # a whole run, not LRU's 10, 3, 4
    assert pool.cached_prefix([hash_block(None, [10, 10])]) == [10]
    oldest = list(pool.evictable)[:2 * 1 + EVICTION_SLACK]
    [b] = pool.allocate(1)
    assert b in oldest and b in [10, 20] + lonely        # a lonely block among the oldest: runs stay whole
    left = pool.num_free_blocks
    assert pool.allocate(left) is not None and pool.num_free_blocks == 0


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


ops = st.lists(st.tuples(st.sampled_from(["alloc", "grow", "cache", "release", "hit", "clear"]),
                         st.integers(0, 10 ** 6)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_events_and_counts_agree_with_a_reference(operations):
    pool = BlockPool(8, 4)
    held: list[list[int]] = []
    mirror: set[bytes] = set()
    for op, r in operations:
        if op == "alloc":
            n = 1 + r % 3
            contiguous_free = max((length for _, length in pool.free.runs()), default=0) >= n
            ids = pool.allocate(n)
            if ids is not None:
                held.append(ids)
                assert not contiguous_free or is_run(ids)   # a run that fits is taken whole
        elif op == "grow" and held:
            ids = held[r % len(held)]
            more = pool.allocate(1 + r % 2, after=ids[-1])
            if more is not None:
                ids.extend(more)
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
        runs = pool.free.runs()                   # maximal runs of exactly the free blocks
        assert all(s1 + n1 < s2 for (s1, n1), (s2, _) in zip(runs, runs[1:]))
        free = [b for s, n in runs for b in range(s, s + n)]
        assert len(free) == len(pool.free) and set(free) == {
            b for b in range(8) if not pool.ref_counts[b] and pool.block_hash[b] is None}
    for ids in held:
        pool.release(ids)
    assert pool.num_free_blocks == 8 and not any(pool.ref_counts)
