"""Chaos under load: a decode worker killed, a prefill worker killed mid-transfer, a decode
worker stopped with SIGTERM. Every request completes, token for token as without the fault,
and every surviving worker returns to idle (no block, reservation or held prefill left).
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import replace

from splitserve.testing.waiting import wait_until
from splitserve.testing.workers import wait_idle, wait_running

from .conftest import (DECODE_FLAGS, FRONTEND_FLAGS, expected_outputs, make_jobs, run_killing, run_load,
                       wait_progress)

def _report(name: str, outcomes, expected, leaked: int, front) -> None:
    completed = sum(o.completed for o in outcomes)
    exact = sum(o.completed and o.token_ids == want for o, want in zip(outcomes, expected))
    migrated = front.metric("splitserve_migrations_total", outcome="migrated")
    retried = front.metric("splitserve_migrations_total", outcome="retried")
    print(f"\n[chaos] {name}: requests={len(outcomes)} completed={completed} token_exact={exact} "
          f"leaked_blocks={leaked} migrated={migrated:.0f} retried={retried:.0f}")


def _leaked_blocks(workers, timeout: float = 2.0) -> int:
    """KV blocks still held on `workers` once they had `timeout` seconds to settle."""
    try:
        wait_idle(workers, timeout)
    except AssertionError:
        pass
    return sum(w.stats().num_used_kv_blocks for w in workers)


def _assert_all_exact(outcomes, expected, jobs, front) -> None:
    errors = [(i, o.error) for i, o in enumerate(outcomes) if not o.completed]
    assert not errors, (errors, front.proc.tail(80))
    wrong = [i for i, (o, want) in enumerate(zip(outcomes, expected)) if o.token_ids != want]
    assert not wrong, [(i, outcomes[i].token_ids, expected[i]) for i in wrong[:3]]
    for o, j in zip(outcomes, jobs):
        assert (o.prompt_tokens, o.completion_tokens) == (len(j.prompt), j.max_tokens)
        assert o.finish_reason == "length"


def test_sigkill_decode_worker_mid_stream_migrates_32_streams(cluster, llama_dir):
    """32 SSE streams (4 of them seeded sampling), plus 4 whole HTTP and 4 public gRPC requests."""
    streams = make_jobs(32, seed=1, min_len=20, max_len=120, max_tokens=40, num_seeded=4)
    others = make_jobs(8, seed=11, min_len=20, max_len=120, max_tokens=40)
    jobs = streams + [replace(j, api="whole" if i < 4 else "grpc") for i, j in enumerate(others)]
    expected = expected_outputs(llama_dir, jobs)
    p0 = cluster.start_worker("p0", "prefill")
    d0 = cluster.start_worker("d0", "decode", *DECODE_FLAGS)
    d1 = cluster.start_worker("d1", "decode", *DECODE_FLAGS)
    cluster.wait_workers()
    front = cluster.start_frontend(*FRONTEND_FLAGS)
    front.wait_ready()
    outcomes, served_by_d0 = run_killing(front, jobs, d0, num_streams=len(streams))
    _report("SIGKILL decode worker", outcomes, expected, _leaked_blocks([p0, d1]), front)
    _assert_all_exact(outcomes, expected, jobs, front)
    migrated = front.metric("splitserve_migrations_total", outcome="migrated")
    assert served_by_d0 > 0 and migrated >= 1, (served_by_d0, migrated)
    assert front.metric("splitserve_migrations_total", outcome="refused_limit") == 0
    wait_idle([p0, d1], 2.0)


def test_sigkill_prefill_worker_mid_transfer_leaks_nothing(cluster, llama_dir):
    jobs = make_jobs(16, seed=2, min_len=300, max_len=500, max_tokens=8)
    expected = expected_outputs(llama_dir, jobs)
    p0 = cluster.start_worker("p0", "prefill", "--max-num-batched-tokens", "256")
    p1 = cluster.start_worker("p1", "prefill", "--max-num-batched-tokens", "256")
    d0 = cluster.start_worker("d0", "decode", *DECODE_FLAGS)
    d1 = cluster.start_worker("d1", "decode", *DECODE_FLAGS)
    cluster.wait_workers()
    front = cluster.start_frontend(*FRONTEND_FLAGS)
    front.wait_ready()

    async def kill_p0_while_prefilling(progress):
        await wait_running(p0.address, interval=0.005)      # p0 is computing (and pushing) a prompt now
        p0.proc.process.send_signal(signal.SIGKILL)

    outcomes = asyncio.run(run_load(front.openai_url, jobs, kill_p0_while_prefilling))
    p0.proc.process.wait(10)
    _report("SIGKILL prefill worker", outcomes, expected, _leaked_blocks([d0, d1]), front)
    _assert_all_exact(outcomes, expected, jobs, front)
    wait_idle([p1, d0, d1], 2.0)
    retried = sum(w.stats().num_prefill_retries + w.stats().num_prefill_fallbacks for w in (d0, d1))
    assert retried >= 1


def test_sigterm_decode_worker_drains_migrates_and_deregisters(cluster, llama_dir, etcd):
    """d0 gets SIGTERM with a 0.5 s drain timeout while it serves long streams: it stops
    admitting, the frontend moves its streams to d1 (with their KV) and those it cannot move
    before the deadline are failed there and migrated to d1 by replay, it revokes its etcd
    lease (the router drops it) and exits 0. The streams are long enough (600 tokens, SIGTERM
    after the first 3 of each) that no machine decodes the rest within the drain timeout: with
    200 tokens and 1 s a fast run finished all 8 of d0's streams in 0.82 s and migrated none."""
    jobs = make_jobs(16, seed=3, min_len=20, max_len=60, max_tokens=600)
    expected = expected_outputs(llama_dir, jobs)
    reg = ["--etcd", etcd.endpoint, "--etcd-ttl", "5"]
    p0 = cluster.start_worker("p0", "prefill", *reg)
    d0 = cluster.start_worker("d0", "decode", *DECODE_FLAGS, *reg, "--drain-timeout", "0.5")
    d1 = cluster.start_worker("d1", "decode", *DECODE_FLAGS, *reg)
    cluster.wait_workers()
    front = cluster.start_frontend(*FRONTEND_FLAGS, "--etcd", etcd.endpoint, workers=[])
    front.wait_ready(num_workers=3)

    async def sigterm_d0(progress):
        await wait_progress(progress, 3)
        d0.proc.process.send_signal(signal.SIGTERM)

    outcomes = asyncio.run(run_load(front.openai_url, jobs, sigterm_d0))
    assert d0.proc.process.wait(20) == 0, d0.proc.tail()
    _report("SIGTERM decode worker", outcomes, expected, _leaked_blocks([p0, d1]), front)
    _assert_all_exact(outcomes, expected, jobs, front)
    # Moved off as d0 turned NOT_SERVING (with their KV), or failed at the drain deadline and migrated.
    moved = sum(front.metric("splitserve_request_moves_total", method=m) for m in ("kv", "replay"))
    assert moved + front.metric("splitserve_migrations_total", outcome="migrated") >= 1, d0.proc.tail()
    wait_until(lambda: 'splitserve_router_index_blocks{worker="d0"}' not in front.metrics(), timeout=5,
               what="the router to drop d0 (deregistered)")
    wait_idle([p0, d1], 2.0)


def test_sigterm_decode_worker_moves_its_streams_away_with_their_kv(cluster, llama_dir):
    """d0 gets SIGTERM with a 30 s drain timeout while it serves long streams (2 of 8 seeded):
    the frontend sees it turn NOT_SERVING and moves each of its streams to d1 with its KV (d0
    suspends it, d1 reads the KV from d0 and computes one token), so d0 has nothing left and exits
    0 long before the timeout; no stream breaks (nothing replayed) and every output is token-exact."""
    jobs = make_jobs(8, seed=5, min_len=100, max_len=300, max_tokens=300, num_seeded=2)
    expected = expected_outputs(llama_dir, jobs)
    p0 = cluster.start_worker("p0", "prefill")
    d0 = cluster.start_worker("d0", "decode", *DECODE_FLAGS, "--drain-timeout", "30")
    d1 = cluster.start_worker("d1", "decode", *DECODE_FLAGS)
    cluster.wait_workers()
    front = cluster.start_frontend(*FRONTEND_FLAGS)
    front.wait_ready()
    async def sigterm_d0(progress):
        await wait_progress(progress, 3)
        await wait_running(d0.address)
        d0.proc.process.send_signal(signal.SIGTERM)

    outcomes = asyncio.run(run_load(front.openai_url, jobs, sigterm_d0))
    assert d0.proc.process.wait(25) == 0, d0.proc.tail()
    _report("SIGTERM decode worker, moved with the KV", outcomes, expected, _leaked_blocks([p0, d1]), front)
    _assert_all_exact(outcomes, expected, jobs, front)
    moved = front.metric("splitserve_request_moves_total", method="kv")
    assert moved >= 1, d0.proc.tail()
    assert front.metric("splitserve_request_moves_total", method="replay") == 0
    assert front.metric("splitserve_migrations_total", outcome="migrated") == 0, front.proc.tail(40)
    assert d1.stats().num_kv_migrations_received == moved
    assert "drained in" in d0.proc.output and "calls still running after" not in d0.proc.output, d0.proc.tail()
    wait_idle([p0, d1], 2.0)
