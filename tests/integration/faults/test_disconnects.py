"""Clients that go away at random points under load (before the first token, during a
remote prefill, mid-stream): every worker's KV is back to idle within 1 s of the last
disconnect, and the frontend counts the cancellations. Then the frontend itself is stopped
with SIGTERM under load: it stops admitting at once and exits 0 once its streams finished."""

from __future__ import annotations

import asyncio
import random
import signal

import pytest

from splitserve.testing.waiting import async_wait_until
from splitserve.testing.workers import wait_idle

from .conftest import FRONTEND_FLAGS, make_jobs, run_load, wait_progress

IDLE_WITHIN_S = 1.0

pytestmark = pytest.mark.alone      # a 1 s bound on freeing the workers: no other test on the cores


def test_random_client_disconnects_leave_every_worker_idle_within_1s_then_frontend_drains(cluster):
    jobs = make_jobs(24, seed=4, min_len=20, max_len=400, max_tokens=64)
    rng = random.Random(4)
    # A float: give up after that many seconds (often before the first token); an int: after that many tokens.
    stop_after = [rng.uniform(0.05, 1.5) if i % 3 == 0 else rng.randrange(1, 60) for i in range(len(jobs))]
    workers = [cluster.start_worker("p0", "prefill"),
               cluster.start_worker("d0", "decode", "--remote-prefill-threshold", "64"),
               cluster.start_worker("d1", "decode", "--remote-prefill-threshold", "64")]
    cluster.wait_workers()
    front = cluster.start_frontend(*FRONTEND_FLAGS)
    front.wait_ready()

    outcomes = asyncio.run(run_load(front.openai_url, jobs, stop_after=stop_after))
    took = wait_idle(workers, IDLE_WITHIN_S).took_s
    disconnected = sum(o.error == "disconnected" for o in outcomes)
    print(f"\n[chaos] client disconnects: requests={len(jobs)} disconnected={disconnected} "
          f"completed={sum(o.completed for o in outcomes)} idle_after_s={took:.2f} leaked_blocks=0")
    assert all(o.error in (None, "disconnected") for o in outcomes), [o.error for o in outcomes]
    assert disconnected >= len(jobs) // 2
    cancelled = front.metric("splitserve_cancellations_total")
    assert cancelled >= 1, front.metrics()

    # Then the frontend gets SIGTERM under load: /ready fails at once, running streams finish, exit 0.
    jobs = make_jobs(8, seed=6, min_len=20, max_len=60, max_tokens=48)

    async def sigterm_frontend(progress):
        await wait_progress(progress, 2)
        front.proc.process.send_signal(signal.SIGTERM)
        await async_wait_until(lambda: front.ready() is None, timeout=5, interval=0.02,   # 503 (draining) reads as None
                               what="/ready to fail once the frontend drains")

    outcomes = asyncio.run(run_load(front.openai_url, jobs, sigterm_frontend))
    assert front.proc.process.wait(30) == 0, front.proc.tail()
    print(f"[chaos] frontend SIGTERM: requests={len(jobs)} completed={sum(o.completed for o in outcomes)}")
    assert all(o.completed for o in outcomes), [o.error for o in outcomes]
    wait_idle(workers, IDLE_WITHIN_S)
