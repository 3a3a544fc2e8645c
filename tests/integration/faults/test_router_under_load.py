"""Issue 6's promises for the router, now under load: two frontends (router replicas) find two
aggregated workers through etcd while clients stream through both.

- etcd stops for a few seconds: routing carries on with the last known workers, and every
  request through the frontend under steady load completes, token for token;
- one frontend is SIGKILLed and restarted: the other one's requests are untouched, the new one
  rebuilds its KV index from the workers' events and serves, and the requests the killed one
  had in flight leave nothing behind on the workers.
"""

from __future__ import annotations

import asyncio

import openai

from splitserve.testing.waiting import async_wait_until
from splitserve.testing.workers import wait_idle

from .conftest import MODEL_NAME, expected_outputs, make_jobs, stream_job

TTL_S = 3
OUTAGE_S = 4.0


async def _steady(base_url: str, jobs, expected, stop: asyncio.Event, results: list) -> None:
    """One client: stream the jobs in turn until `stop`; results get (ok, exact, error)."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60) as client:
        i = 0
        while not stop.is_set():
            j = i % len(jobs)
            out = await stream_job(client, jobs[j], [0], 0)
            results.append((out.completed, out.token_ids == expected[j], out.error))
            i += 1


def test_etcd_outage_and_router_restart_under_load(cluster, llama_dir, etcd):
    jobs = make_jobs(6, seed=5, min_len=20, max_len=200, max_tokens=12)
    expected = expected_outputs(llama_dir, jobs)
    reg = ["--etcd", etcd.endpoint, "--etcd-ttl", str(TTL_S)]
    workers = [cluster.start_worker(f"w{i}", "both", *reg) for i in range(2)]
    cluster.wait_workers()
    router = ["--router", "kv", "--served-model-name", MODEL_NAME, "--etcd", etcd.endpoint]
    steady_front = cluster.start_frontend(*router, workers=[])
    victim = cluster.start_frontend(*router, workers=[])
    for f in (steady_front, victim):
        f.wait_ready(num_workers=2)

    async def scenario():
        nonlocal victim
        stop, steady, victim_results = asyncio.Event(), [], []
        clients = [asyncio.create_task(_steady(steady_front.openai_url, jobs, expected, stop, steady))
                   for _ in range(3)]
        victim_clients = [asyncio.create_task(_steady(victim.openai_url, jobs, expected, stop, victim_results))
                          for _ in range(2)]
        await async_wait_until(lambda: len(steady) >= 3 and victim_results, timeout=60, interval=0.05,
                               what="requests completing through both frontends")
        etcd.stop()                                       # the outage
        before_outage = len(steady)
        await asyncio.sleep(OUTAGE_S)                     # the load runs on through the outage
        during_outage = len(steady) - before_outage
        etcd.start()
        victim.proc.process.kill()                        # the router restart
        await asyncio.to_thread(victim.proc.process.wait, 10)
        stop.set()
        await asyncio.gather(*victim_clients)
        # A new replica: it finds the workers in etcd and rebuilds its index from their events.
        victim = cluster.start_frontend(*router, workers=[])
        await asyncio.to_thread(victim.wait_ready, 2)
        def indexed_both() -> bool:
            metrics = victim.metrics()
            return all(f'splitserve_router_index_blocks{{worker="w{i}"}} 0.0' not in metrics for i in range(2))

        await async_wait_until(indexed_both, timeout=10, what="the new replica's index to hold blocks of both workers",
                               details=victim.metrics)
        restarted = []
        stop2 = asyncio.Event()
        task = asyncio.create_task(_steady(victim.openai_url, jobs, expected, stop2, restarted))
        await async_wait_until(lambda: len(restarted) >= 3, timeout=60, interval=0.05,
                               what="three requests through the new replica")
        stop2.set()
        await asyncio.gather(task, *clients)
        return steady, during_outage, restarted

    steady, during_outage, restarted = asyncio.run(scenario())
    took = wait_idle(workers, 2.0).took_s
    print(f"\n[chaos] router under load: steady requests={len(steady)} (during the etcd outage: {during_outage}) "
          f"completed={sum(ok for ok, _, _ in steady)} token_exact={sum(ex for _, ex, _ in steady)}; "
          f"after the router restart: {sum(ok for ok, _, _ in restarted)}/{len(restarted)}; idle after {took:.2f} s")
    assert during_outage >= 3
    assert all(ok and exact for ok, exact, _ in steady), [e for ok, ex, e in steady if not (ok and ex)]
    assert restarted and all(ok and exact for ok, exact, _ in restarted), restarted
