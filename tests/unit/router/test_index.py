"""KvIndex against a brute-force reference on random event sequences, and worked examples."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.block_hashes import ChainHasher, block_hashes, hash_block
from splitserve.router.index import CLEARED, REMOVED, STORED, KvIndex

WORKERS = ["w0", "w1", "w2"]
HASHES = [bytes([i]) * 4 for i in range(12)]

KINDS = ["stored", "removed", "cleared", "predict", "predict", "tick", "tick"]     # predictions and time: often
events = st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from(WORKERS),
                            st.lists(st.sampled_from(HASHES), max_size=5)), max_size=60)
queries = st.lists(st.lists(st.sampled_from(HASHES), max_size=8), min_size=1, max_size=5)
TTL = 3.0


class Reference:
    """The index's meaning, by brute force: per worker, stored hashes and predicted hash -> deadline."""

    def __init__(self):
        self.stored = {w: set() for w in WORKERS}
        self.predicted = {w: {} for w in WORKERS}

    def apply(self, kind, w, hashes, now):
        if kind == "stored":                              # confirms a prediction
            self.stored[w] |= set(hashes)
            for h in hashes:
                self.predicted[w].pop(h, None)
        elif kind == "removed":                           # drops stored and predicted alike
            self.stored[w] -= set(hashes)
            for h in hashes:
                self.predicted[w].pop(h, None)
        elif kind == "cleared":
            self.stored[w].clear()
            self.predicted[w].clear()
        elif kind == "predict":                           # held blocks untouched; a re-prediction extends
            for h in hashes:
                if h not in self.stored[w]:
                    self.predicted[w][h] = now + TTL

    def held(self, now):
        return {w: self.stored[w] | {h for h, d in self.predicted[w].items() if d > now} for w in WORKERS}


def brute_overlaps(held: dict[str, set[bytes]], chain: list[bytes]) -> dict[str, int]:
    out = {}
    for w, blocks in held.items():
        n = 0
        while n < len(chain) and chain[n] in blocks:
            n += 1
        if n:
            out[w] = n
    return out


def apply_to_index(index, kind, w, hashes, now):
    if kind == "stored":
        index.stored(w, hashes)
    elif kind == "removed":
        index.removed(w, hashes)
    elif kind == "cleared":
        index.clear_worker(w)
    elif kind == "predict":
        index.predict(w, list(hashes), now + TTL)


@settings(max_examples=300, deadline=None)
@given(events, queries)
def test_index_matches_brute_force(evs, chains):
    """Stored, removed, cleared, predicted and expired entries, against the reference at every step."""
    index, ref, now = KvIndex(), Reference(), 0.0
    for kind, w, hashes in evs:
        if kind == "tick":                                # time passes: 0.5-2.5 s, so some predictions lapse
            now += 0.5 * (1 + len(hashes) % 5)
            index.expire(now)
        apply_to_index(index, kind, w, hashes, now)
        ref.apply(kind, w, hashes, now)
        held = ref.held(now)
        for chain in chains:
            assert index.overlaps(chain) == brute_overlaps(held, chain)
        for x in WORKERS:
            assert index.num_blocks(x) == len(ref.stored[x])
            assert index.num_predicted(x) == len(held[x] - ref.stored[x])
            assert [index.holds(x, h) for h in HASHES] == [h in held[x] for h in HASHES]
    index.expire(now + TTL)                               # every prediction lapses
    assert all(index.num_predicted(w) == 0 for w in WORKERS)
    for w in WORKERS:
        index.clear_worker(w)
    assert index._holders == {} and index.workers() == []      # leak check


@settings(max_examples=200, deadline=None)
@given(events, queries)
def test_batched_apply_equals_one_call_per_event(evs, chains):
    one_by_one, batched = KvIndex(), KvIndex()
    kinds = {"stored": STORED, "removed": REMOVED, "cleared": CLEARED}
    evs = [e for e in evs if e[0] in kinds]
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
def test_block_hashes_are_the_chain_of_block_hashes_and_continue_from_any_start(token_ids, block_size, extra_key):
    """The engine and the router both call block_hashes: it must be the chain that hash_block
    defines, whether it hashes from the first block or continues a sequence's known hashes."""
    chain: list[bytes] = []
    for b in range(len(token_ids) // block_size):
        chain.append(hash_block(chain[-1] if chain else None, token_ids[b * block_size:(b + 1) * block_size],
                                extra_key))
    assert block_hashes(token_ids, block_size, extra_key) == chain
    for known in range(len(chain) + 1):
        assert block_hashes(token_ids, block_size, extra_key, chain[:known]) == chain


def test_predicted_blocks_count_until_confirmed_by_stored_events():
    index = KvIndex()
    a, b, c = (bytes([i]) for i in range(3))
    index.predict("w0", [a, b, c], deadline=10.0)          # routed there; the worker has not computed it yet
    assert index.overlaps([a, b, c]) == {"w0": 3}
    assert (index.num_blocks("w0"), index.num_predicted("w0")) == (0, 3)
    index.stored("w0", [a, b])                             # its BlockStored events confirm two of them
    assert (index.num_blocks("w0"), index.num_predicted("w0")) == (2, 1)
    assert index.expire(10.0) == 1                         # the unconfirmed one lapses at its deadline
    assert index.overlaps([a, b, c]) == {"w0": 2}          # confirmed blocks never expire
    index.clear_worker("w0")
    assert index._holders == {}


def test_predictions_expire_and_re_prediction_extends_them():
    index = KvIndex()
    a, b = bytes([1]), bytes([2])
    index.predict("w0", [a, b], deadline=5.0)
    index.predict("w1", [a], deadline=5.0)
    index.predict("w0", [a], deadline=8.0)                 # a second request with the same prefix
    assert index.expire(4.9) == 0
    assert index.expire(5.0) == 2                          # w0's b and w1's a; w0's a lives on
    assert index.overlaps([a, b]) == {"w0": 1}
    assert index.expire(8.0) == 1
    assert index.overlaps([a, b]) == {} and index._holders == {}


def test_expiry_can_be_spread_over_calls():
    index = KvIndex()
    for i in range(5):
        index.predict("w0", [bytes([i])], deadline=1.0 + i * 0.1)
    assert index.expire(10.0, max_runs=2) == 2           # a decision after an idle spell: bounded work
    assert index.num_predicted("w0") == 3                # the rest still count as held until later calls
    assert index.expire(10.0) == 3 and index._holders == {}


def test_removed_and_cleared_drop_predictions_and_held_blocks_are_not_predicted():
    index = KvIndex()
    a, b, c = (bytes([i]) for i in range(3))
    index.stored("w0", [a])
    index.predict("w0", [a, b, c], deadline=5.0)           # a is held already: only b and c are predicted
    assert index.num_predicted("w0") == 2
    index.removed("w0", [b])                               # evicted as it was stored, say
    assert index.overlaps([a, b, c]) == {"w0": 1} and index.num_predicted("w0") == 1
    index.apply("w0", [(CLEARED, ())])                     # AllCleared: predictions go too
    assert index.overlaps([a, b, c]) == {} and index.num_predicted("w0") == 0
    index.predict("w1", [a], deadline=5.0)
    index.clear_worker("w1")                               # the worker leaves routing
    assert index.expire(6.0) == 0 and index._holders == {}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 5), max_size=40)), min_size=1, max_size=30),
       st.sampled_from([1, 4]), st.sampled_from([b"", b"k"]), st.integers(1, 40))
def test_the_memoized_hasher_always_equals_block_hashes(prompts, block_size, extra_key, capacity):
    """Prompts built from 4 shared prefixes (so the memo hits, misses part-way and evicts)."""
    prefixes = [[p] * 12 + list(range(p, p + 12)) for p in range(4)]
    hasher = ChainHasher(capacity)
    for which, tail in prompts:
        tokens = prefixes[which] + tail
        assert hasher(tokens, block_size, extra_key) == block_hashes(tokens, block_size, extra_key)
        assert len(hasher._memo) <= capacity


def test_the_memo_remembers_a_prefix_from_its_second_sighting():
    hasher, prefix = ChainHasher(), list(range(64))
    hasher(prefix + [1], 16)
    assert hasher._memo == {}                              # seen once: a prompt that may never recur
    hasher(prefix + [2], 16)
    assert len(hasher._memo) == 4                          # seen twice: its blocks are remembered
    hasher(list(range(1000, 1064)), 16)
    assert len(hasher._memo) == 4
