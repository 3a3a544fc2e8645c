"""The load model and RouterCore: accounting, Stats corrections, conditional disaggregation."""

from __future__ import annotations

import time

from prometheus_client import generate_latest

from splitserve.router.core import RouterCore, WorkerSpec
from splitserve.router.hashing import block_hashes
from splitserve.router.load import LoadTracker
from splitserve.router.metrics import RouterMetrics
from splitserve.router.policies import make_policy


def test_load_tracks_route_first_token_finish():
    load = LoadTracker()
    load.on_route("r1", "d0", "p0", 100, 7)
    load.on_route("r2", "d0", None, 30, 2)
    assert load.pending_prefill_tokens("p0") == 100 and load.pending_prefill_tokens("d0") == 30
    assert load.decode_blocks("d0") == 9
    load.on_first_token("r1")
    assert load.pending_prefill_tokens("p0") == 0
    load.on_finished("r1")
    load.on_finished("r2")
    load.on_finished("r2")                      # idempotent
    assert load.decode_blocks("d0") == 0 and load.pending_prefill_tokens("d0") == 0
    assert load.num_requests() == 0


def test_load_is_corrected_from_stats():
    load = LoadTracker(stale_after_s=0.0)
    load.on_route("r1", "d0", None, 50, 4)
    load.correct("d0", num_used_blocks=20, num_in_flight=3)       # other frontends' work counts too
    assert load.decode_blocks("d0") == 20
    time.sleep(0.001)
    load.correct("d0", num_used_blocks=0, num_in_flight=0)        # idle worker: drop stale requests
    assert load.decode_blocks("d0") == 0 and load.num_requests() == 0


def _core(policy="kv", threshold=32):
    core = RouterCore(make_policy(policy), make_policy(policy), remote_prefill_threshold=threshold,
                      metrics=RouterMetrics())
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
    core.on_first_token("r2")
    core.on_finished("r2")
    assert core.load.num_requests() == 0
    text = generate_latest(core.metrics.registry).decode()
    assert 'splitserve_router_last_decision{leg="decode"' in text and "runner_up=" in text


def test_core_spreads_load_when_nothing_is_cached():
    core = _core()
    chosen = [core.route(f"r{i}", list(range(i * 1000, i * 1000 + 64)), ["d0", "d1"], []).decode.winner.worker_id
              for i in range(4)]
    assert sorted(chosen) == ["d0", "d0", "d1", "d1"]
    assert core.route("x", [1, 2, 3], [], []) is None
