"""The routing policies: cost function properties, worked examples with known winners."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from splitserve.router.policies import Candidate, CandidateTable, KvPolicy, kv_cost, make_policy
from splitserve.router.policies.base import lowest

cands = st.lists(st.builds(Candidate, st.sampled_from([f"w{i}" for i in range(6)]), st.integers(0, 20),
                           st.integers(0, 50), st.integers(0, 50), st.integers(0, 3)), min_size=1, max_size=6,
                 unique_by=lambda c: c.worker_id)


@given(cands, st.integers(0, 20), st.floats(0, 4))
def test_kv_picks_the_brute_force_minimum(candidates, prompt_blocks, weight):
    d = KvPolicy(prefill_weight=weight).choose(prompt_blocks, candidates)
    costs = {c.worker_id: weight * max(prompt_blocks - c.overlap_blocks, 0) + c.pending_prefill_blocks
             + c.decode_blocks for c in candidates}
    best = min(costs.values())
    assert abs(d.winner.cost - best) < 1e-9
    tied = [c for c in candidates if abs(costs[c.worker_id] - best) < 1e-9]
    assert d.winner.candidate.load == min(c.load for c in tied)          # ties to the less loaded
    tied = [c for c in tied if c.load == d.winner.candidate.load]
    assert d.winner.candidate.cached_blocks == min(c.cached_blocks for c in tied)   # then the emptier cache
    if len(candidates) > 1:
        assert d.runner_up is not None and d.runner_up.cost >= d.winner.cost


@given(cands, st.integers(0, 20), st.sampled_from([0.0, 0.3, 1.0, 2.5]))
def test_kv_column_scoring_equals_scoring_every_candidate(candidates, prompt_blocks, weight):
    """The columnar fast path decides exactly what `lowest()` over all scored candidates decides."""
    reference = lowest("kv", [kv_cost(prompt_blocks, c, weight) for c in candidates])
    for given_as in (candidates, CandidateTable.of(candidates)):
        assert KvPolicy(prefill_weight=weight).choose(prompt_blocks, given_as) == reference


def test_worked_examples():
    # 10-block prompt. w0 holds 8 blocks but is busy; w1 holds nothing and is idle; w2 holds 6.
    c = [Candidate("w0", 8, 0, 9), Candidate("w1", 0, 0, 0), Candidate("w2", 6, 1, 2)]
    assert kv_cost(10, c[0], prefill_weight=1).cost == 2 + 9
    d = KvPolicy(prefill_weight=1).choose(10, c)
    assert (d.winner.worker_id, d.winner.cost, d.runner_up.worker_id) == ("w2", 7, "w1")
    # The default weight 2 (an uncached block is prefill time and new memory): w2 2*4+3=11, w0 2*2+9=13, w1 20.
    d = KvPolicy().choose(10, c)
    assert (d.winner.worker_id, d.winner.cost, d.runner_up.worker_id, d.runner_up.cost) == ("w2", 11, "w0", 13)
    # Overlap weighs more with a higher prefill weight: at 4, w0 (4*2+9=17) beats w2 (4*4+3=19) and w1 (40).
    assert KvPolicy(prefill_weight=4).choose(10, c).winner.worker_id == "w0"
    # Equal cost: the less loaded wins (w1: 5 uncached + 0 load; w0: 0 uncached + 5 load).
    tie = [Candidate("w0", 5, 2, 3), Candidate("w1", 0, 0, 0)]
    assert KvPolicy(prefill_weight=1).choose(5, tie).winner.worker_id == "w1"
    assert "runner-up w0" in KvPolicy(prefill_weight=1).choose(5, tie).explain()
    # Weight 0 ignores the cache: the least loaded wins, ties to the smaller id.
    assert KvPolicy(prefill_weight=0).choose(10, c + [Candidate("a", 0, 0, 0)]).winner.worker_id == "a"


def test_a_prefix_nobody_holds_goes_to_the_emptier_cache():
    """Worked example: 8 tenants' 64-block prefixes, 4 idle workers. A new tenant's 66-block prompt
    costs 2 * 66 = 132 everywhere; it goes to the idle worker caching the fewest blocks (here w3,
    which holds no tenant yet), not to the first id (w0, which holds two tenants already)."""
    c = [Candidate("w0", 0, 0, 0, 128), Candidate("w1", 0, 0, 0, 64), Candidate("w2", 0, 0, 0, 64),
         Candidate("w3", 0, 0, 0, 0)]
    for given_as in (c, CandidateTable.of(c)):
        d = KvPolicy().choose(66, given_as)
        assert (d.winner.worker_id, d.winner.cost, d.runner_up.worker_id) == ("w3", 132, "w1")
        assert "cached=0" in d.explain() and "runner-up w1 (cost=132" in d.explain()
    # Load still comes first: an emptier cache does not beat a shorter queue (w3 is prefilling 2 blocks).
    busy = [Candidate("w0", 0, 0, 0, 128), Candidate("w3", 0, 2, 0, 0)]
    assert KvPolicy().choose(66, busy).winner.worker_id == "w0"
    # And the cache only breaks ties: the holder of this tenant (w0, 64 of 66 blocks) wins outright.
    assert KvPolicy().choose(66, [Candidate("w0", 64, 0, 0, 128), *c[1:]]).winner.worker_id == "w0"


def test_temperature_is_seeded_and_prefers_cheap():
    c = [Candidate("w0", 10, 0, 0), Candidate("w1", 0, 0, 0), Candidate("w2", 0, 0, 0)]
    picks = [KvPolicy(temperature=0.5, seed=7).choose(10, c).winner.worker_id for _ in range(3)]
    assert len(set(picks)) == 1                                   # the same seed, the same choice
    p = KvPolicy(temperature=0.5, seed=1)
    counts = Counter(p.choose(10, c).winner.worker_id for _ in range(600))
    assert counts["w0"] > counts["w1"] and counts["w0"] > counts["w2"] and counts["w1"] > 0


def test_other_policies():
    c = [Candidate("b", 0, 3, 0), Candidate("a", 9, 0, 1), Candidate("c", 0, 0, 7)]
    rr = make_policy("round-robin")
    assert [rr.choose(1, c).winner.worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    assert make_policy("least-loaded").choose(1, c).winner.worker_id == "a"
    r1, r2 = make_policy("random", seed=3), make_policy("random", seed=3)
    assert [r1.choose(1, c).winner.worker_id for _ in range(20)] == [r2.choose(1, c).winner.worker_id
                                                                     for _ in range(20)]
    p2 = make_policy("power-of-two", seed=0)
    for _ in range(30):
        d = p2.choose(1, c)
        assert d.runner_up is not None and d.winner.candidate.load <= d.runner_up.candidate.load
    for name in ("kv", "round-robin", "random", "least-loaded", "power-of-two"):
        assert make_policy(name).choose(1, []) is None
