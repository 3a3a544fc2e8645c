"""The load model and RouterCore: accounting, Stats corrections, conditional disaggregation."""

from __future__ import annotations

from prometheus_client import generate_latest

from splitserve.router.core import RouterCore, WorkerSpec
from splitserve.block_hashes import block_hashes
from splitserve.router.load import LoadTracker
from splitserve.router.metrics import RouterMetrics
from splitserve.router.policies import make_policy
from splitserve.testing.clock import FakeClock


def test_load_tracks_route_first_token_finish():
    load = LoadTracker()
    load.on_route("r1", "d0", "p0", 100, 7)
    load.on_route("r2", "d0", None, 30, 2)
    assert load.pending_prefill_tokens("p0") == 100 and load.pending_prefill_tokens("d0") == 30
    assert load.decode_blocks("d0") == 0                   # prefilling: counted as prefill work only
    load.on_first_token("r1")
    assert load.pending_prefill_tokens("p0") == 0 and load.decode_blocks("d0") == 7
    load.on_finished("r1")
    load.on_finished("r2")                                 # finished before its first token
    load.on_finished("r2")                                 # idempotent
    assert load.decode_blocks("d0") == 0 and load.pending_prefill_tokens("d0") == 0
    assert load.num_requests() == 0


def test_load_counts_only_the_blocks_a_request_adds():
    """Worked example: a 64-block prefix cached on d0 and ten 66-block prompts over it."""
    prefix = [bytes([i]) * 4 for i in range(64)]
    load = LoadTracker()
    for i in range(10):
        chain = prefix + [b"q%da" % i, b"q%db" % i]
        load.on_route(f"r{i}", "d0", None, 32, 66 + 1 - 64, chain)   # 1056 + 1 tokens: 67 blocks, 64 held
        load.on_first_token(f"r{i}")
    assert load.decode_blocks("d0") == 10 * 3              # not 10 * 67: the prefix is shared, not new memory
    # The worker reports the blocks its requests hold, each shared block once: 64 + 10 * (2 + 1 tail).
    load.correct("d0", num_used_blocks=64 + 10 * 3, num_in_flight=10)
    assert load.own_blocks_in_use("d0") == 94 and load.decode_blocks("d0") == 30   # all of it is ours
    load.correct("d0", num_used_blocks=94 + 40, num_in_flight=12)   # another frontend's requests hold 40
    assert load.decode_blocks("d0") == 30 + 40
    for i in range(10):
        load.on_finished(f"r{i}")
    load.correct("d0", num_used_blocks=40, num_in_flight=2)
    assert load.decode_blocks("d0") == 40 and load.own_blocks_in_use("d0") == 0


def test_a_worker_that_leaves_takes_its_requests_load_with_it():
    load = LoadTracker()
    load.on_route("r1", "d0", "p0", 64, 4, [b"a"])
    load.on_route("r2", "d1", None, 32, 2, [b"b"])
    load.forget("d0")                                      # lease lost: r1 ends, p0's pending prefill too
    assert load.pending_prefill_tokens("p0") == 0 and load.num_requests() == 1
    load.on_finished("r1")                                 # the late finish changes nothing
    assert load.decode_blocks("d0") == 0 and load.pending_prefill_tokens("d0") == 0


def test_load_is_corrected_from_stats():
    clock = FakeClock(100.0)
    load = LoadTracker(stale_after_s=0.0, clock=clock)
    load.on_route("r1", "d0", None, 50, 4, [b"a", b"b", b"c"])
    load.on_first_token("r1")
    load.correct("d0", num_used_blocks=20, num_in_flight=3)       # other frontends' work counts too
    assert load.decode_blocks("d0") == 4 + (20 - 4)
    clock.advance(0.001)
    load.correct("d0", num_used_blocks=0, num_in_flight=0)        # idle worker: drop stale requests
    assert load.decode_blocks("d0") == 0 and load.num_requests() == 0


def _core(policy="kv", threshold=32, clock=None):
    core = RouterCore(make_policy(policy), make_policy(policy), remote_prefill_threshold=threshold,
                      metrics=RouterMetrics(), clock=clock or FakeClock(100.0), prediction_ttl_s=5.0)
    for w in ("d0", "d1", "p0", "p1"):
        core.set_spec(w, WorkerSpec(16, b"m|x|"))
    return core


def test_core_prefers_the_worker_holding_the_prefix_and_disaggregates_conditionally():
    core = _core()
    prompt = list(range(160))                                      # 10 blocks
    core.index.stored("d1", block_hashes(prompt, 16, b"m|x|")[:9])
    d = core.route("r1", prompt, ["d0", "d1"], ["p0", "p1"])
    assert d.decode.winner.worker_id == "d1" and d.decode.winner.candidate.overlap_blocks == 9
    assert d.prefill is None and "local prefill (16 uncached tokens < 32)" in d.reason
    core.on_finished("r1")
    other = list(range(1000, 1160))
    d = core.route("r2", other, ["d0", "d1"], ["p0", "p1"])
    assert d.prefill is not None and d.reason == "remote prefill"
    assert core.load.pending_prefill_tokens(d.prefill.winner.worker_id) == 160
    # Both the prefill worker (computes it) and the decode worker (receives it) will cache the prompt.
    assert core.index.num_predicted(d.prefill.winner.worker_id) == 10
    assert core.index.num_predicted(d.decode.winner.worker_id) == 10
    core.on_first_token("r2")
    core.on_finished("r2")
    assert core.load.num_requests() == 0
    text = generate_latest(core.metrics.registry).decode()
    assert 'splitserve_router_last_decision{leg="decode"' in text and "runner_up=" in text


def test_a_decode_worker_is_paired_only_with_prefill_workers_of_its_kv_layout():
    """A vLLM decode worker's paged buffer cannot take a built-in prefill worker's blocks."""
    core = _core()
    layout = {"d0": "paged", "d1": "paged", "p0": "layer-major", "p1": "paged"}
    same = lambda d, p: layout[d] == layout[p]        # noqa: E731
    for i in range(4):
        d = core.route(f"r{i}", list(range(1000 * i, 1000 * i + 160)), ["d0", "d1"], ["p0", "p1"], pairs=same)
        assert d.prefill.winner.worker_id == "p1"
        core.on_finished(f"r{i}")
    layout["p1"] = "layer-major"
    d = core.route("none", list(range(9000, 9160)), ["d0", "d1"], ["p0", "p1"], pairs=same)
    assert d.prefill is None and d.reason == "local prefill (no prefill worker of its KV layout)"


def test_core_spreads_load_when_nothing_is_cached():
    core = _core()
    chosen = [core.route(f"r{i}", list(range(i * 1000, i * 1000 + 64)), ["d0", "d1"], []).decode.winner.worker_id
              for i in range(4)]
    assert sorted(chosen) == ["d0", "d0", "d1", "d1"]
    assert core.route("x", [1, 2, 3], [], []) is None


def test_a_routed_prompt_is_predicted_so_its_tenant_follows_it():
    """Three simultaneous requests of one tenant, before any KV event: all go to the first one's worker."""
    clock = FakeClock(100.0)
    core = _core(clock=clock)
    prefix = list(range(5000, 5000 + 64 * 16))
    chain = block_hashes(prefix, 16, b"m|x|")
    first = core.route("r0", prefix + list(range(32)), ["d0", "d1"], [])
    holder = first.decode.winner.worker_id
    assert first.decode.winner.candidate.overlap_blocks == 0
    assert core.index.num_predicted(holder) == 66 and core.index.num_blocks(holder) == 0
    for i in (1, 2):
        d = core.route(f"r{i}", prefix + list(range(100 * i, 100 * i + 32)), ["d0", "d1"], [])
        # holder: 2 * 2 uncached + 66 pending (r0's prefill) + 2 * 2 (r1's) = 74 at most; the other: 2 * 66 = 132
        assert d.decode.winner.worker_id == holder and d.decode.winner.candidate.overlap_blocks == 64
    assert core.load.pending_prefill_tokens(holder) == 1056 + 2 * 32        # only the questions are new
    core.index.stored(holder, chain)                                        # the worker confirms the prefix
    clock.now += 5.0                                                        # the questions never were reported
    core.index.expire(clock.now)
    assert core.index.num_predicted(holder) == 0 and core.index.num_blocks(holder) == 64
    for i in range(3):
        core.on_first_token(f"r{i}")
    assert core.load.decode_blocks(holder) == 66 + 2 + 2
    for i in range(3):
        core.on_finished(f"r{i}")
    assert core.load.num_requests() == 0 and core.load.decode_blocks(holder) == 0


def test_the_prefix_holder_wins_while_busy_and_a_new_tenant_goes_to_an_idle_worker():
    core = _core()
    prefix = list(range(7000, 7000 + 64 * 16))
    core.index.stored("d0", block_hashes(prefix, 16, b"m|x|"))
    other = core.route("busy", list(range(90000, 90000 + 66 * 16)), ["d0"], [])    # d0 prefills another tenant
    assert other.decode.winner.worker_id == "d0"
    d = core.route("t", prefix + list(range(32)), ["d0", "d1"], [])
    assert (d.decode.winner.worker_id, d.decode.winner.cost, d.decode.runner_up.cost) == ("d0", 2 * 2 + 66, 2 * 66)
    n = core.route("new", list(range(50000, 50000 + 66 * 16)), ["d0", "d1"], [])
    assert n.decode.winner.worker_id == "d1"                                       # 132 < 2 * 66 + 68
    for r in ("busy", "t", "new"):
        core.on_finished(r)
    assert core.load.num_requests() == 0


def test_no_predictions_when_no_leg_reads_the_index():
    core = RouterCore(make_policy("round-robin"), make_policy("round-robin"), predict=False)
    core.route("r", list(range(64)), ["d0"], [])
    assert core.index.num_predicted("d0") == 0


def test_core_spreads_new_prefixes_over_equally_idle_workers():
    """Four idle workers and four tenants arriving one after another, each finishing before the next:
    every tenant's prefix lands on a different worker (the cache tie-break), and each tenant's next
    request then goes to the worker that holds its prefix."""
    core = RouterCore(make_policy("kv"), make_policy("kv"))
    ids = ["w0", "w1", "w2", "w3"]
    for w in ids:
        core.set_spec(w, WorkerSpec(16, b"k"))
    prompts = [[t * 1000 + i for i in range(1024)] for t in range(4)]
    homes = []
    for t, p in enumerate(prompts):
        d = core.route(f"t{t}", p + [7] * 32, ids, [])
        homes.append(d.decode.winner.worker_id)
        core.on_first_token(f"t{t}")
        core.on_finished(f"t{t}")
    assert sorted(homes) == ids                            # not all on w0, the smallest id
    for t, p in enumerate(prompts):
        d = core.route(f"t{t}q", p + [9] * 32, ids, [])
        assert d.decode.winner.worker_id == homes[t] and d.decode.winner.candidate.overlap_blocks == 64
        core.on_finished(f"t{t}q")
    assert core.load.num_requests() == 0


def test_a_salted_request_overlaps_only_blocks_of_its_salt():
    """The router salts its hash chain exactly as the worker salts its block hashes
    (router.hashing.salted_key), so KV-aware routing holds per salt."""
    from splitserve.block_hashes import salted_key

    core = _core()
    prompt = list(range(160))
    core.index.stored("d0", block_hashes(prompt, 16, b"m|x|")[:9])                       # unsalted
    core.index.stored("d1", block_hashes(prompt, 16, salted_key(b"m|x|", "tenant-a"))[:9])
    salted = core.route("r1", prompt, ["d0", "d1"], [], cache_salt="tenant-a")
    assert salted.decode.winner.worker_id == "d1" and salted.decode.winner.candidate.overlap_blocks == 9
    plain = core.route("r2", prompt, ["d0", "d1"], [])
    assert plain.decode.winner.worker_id == "d0" and plain.decode.winner.candidate.overlap_blocks == 9
    other = core.route("r3", prompt, ["d0", "d1"], [], cache_salt="tenant-b")
    assert other.decode.winner.candidate.overlap_blocks == 0
    assert salted_key(b"m|x|", "") == b"m|x|" and salted_key(b"k", "a") != salted_key(b"k", "b")
