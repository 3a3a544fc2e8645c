"""KvIndex against a brute-force reference on random event sequences, and worked examples."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.router.hashing import block_hashes
from splitserve.router.index import CLEARED, REMOVED, STORED, KvIndex
from splitserve.services.engine.block_hash import hash_full_blocks

WORKERS = ["w0", "w1", "w2"]
HASHES = [bytes([i]) * 4 for i in range(12)]

events = st.lists(st.tuples(st.sampled_from(["stored", "removed", "cleared"]), st.sampled_from(WORKERS),
                            st.lists(st.sampled_from(HASHES), max_size=5)), max_size=60)
queries = st.lists(st.lists(st.sampled_from(HASHES), max_size=8), min_size=1, max_size=5)


def brute_overlaps(held: dict[str, set[bytes]], chain: list[bytes]) -> dict[str, int]:
    out = {}
    for w, blocks in held.items():
        n = 0
        while n < len(chain) and chain[n] in blocks:
            n += 1
        if n:
            out[w] = n
    return out


@settings(max_examples=300, deadline=None)
@given(events, queries)
def test_index_matches_brute_force(evs, chains):
    index, held = KvIndex(), {w: set() for w in WORKERS}
    for kind, w, hashes in evs:
        if kind == "stored":
            index.stored(w, hashes)
            held[w] |= set(hashes)
        elif kind == "removed":
            index.removed(w, hashes)
            held[w] -= set(hashes)
        else:
            index.clear_worker(w)
            held[w].clear()
        for chain in chains:
            assert index.overlaps(chain) == brute_overlaps(held, chain)
    for w in WORKERS:
        assert index.num_blocks(w) == len(held[w])
    for w in WORKERS:
        index.clear_worker(w)
    assert index._holders == {} and index.workers() == []      # leak check


@settings(max_examples=200, deadline=None)
@given(events, queries)
def test_batched_apply_equals_one_call_per_event(evs, chains):
    one_by_one, batched = KvIndex(), KvIndex()
    kinds = {"stored": STORED, "removed": REMOVED, "cleared": CLEARED}
    for w in WORKERS:
        batched.apply(w, [(kinds[k], hashes) for k, wid, hashes in evs if wid == w])
        for kind, wid, hashes in evs:
            if wid != w:
                continue
            if kind == "stored":
                one_by_one.stored(w, hashes)
            elif kind == "removed":
                one_by_one.removed(w, hashes)
            else:
                one_by_one.clear_worker(w)
    for chain in chains:
        assert batched.overlaps(chain) == one_by_one.overlaps(chain)
    for w in WORKERS:
        assert batched.num_blocks(w) == one_by_one.num_blocks(w)
        batched.clear_worker(w)
    assert batched._holders == {}


def test_worked_example_longest_prefix():
    index = KvIndex()
    a, b, c, d = (bytes([i]) for i in range(4))
    index.stored("w0", [a, b, c])
    index.stored("w1", [a, b])
    index.stored("w2", [b, c, d])          # holds later blocks but not the first: overlap 0
    assert index.overlaps([a, b, c, d]) == {"w0": 3, "w1": 2}
    index.removed("w0", [b])
    assert index.overlaps([a, b, c, d]) == {"w0": 1, "w1": 2}
    assert index.overlaps([]) == {}


@given(st.lists(st.integers(0, 31999), max_size=80), st.sampled_from([1, 4, 16]), st.binary(max_size=20))
def test_router_hashes_equal_the_engine_hashes(token_ids, block_size, extra_key):
    assert block_hashes(token_ids, block_size, extra_key) == hash_full_blocks(token_ids, block_size, extra_key)
