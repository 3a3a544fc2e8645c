"""A prefill worker that dies, hangs or is gone: the decode worker retries another prefill
worker, then prefills locally, within its deadline, and keeps no reservation; the blocks
it granted to a worker that cannot confirm it stopped writing (hung) stay fenced until
the grant is over.

Real `splitserve worker` processes (one decode, two prefill, TCP transfer) driven over
the worker gRPC API, so each test names exactly which prefill workers the decode worker
may use. The output is compared with the aggregated engine's: a retried or locally
prefilled request produces the same greedy tokens.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import pytest

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.kvtransfer.sender_receiver import GRANT_GRACE_S
from splitserve.testing.cluster import Cluster
from splitserve.testing.workers import generate, wait_idle, wait_running, worker_stats

PROMPTS = {name: [(7 * i + 31 * k) % 31000 + 5 for i in range(n)]
           for k, (name, n) in enumerate([("warm", 100), ("killed", 2500), ("dead", 150), ("hung", 160)])}
MAX_TOKENS = 5
# Covers the killed worker's attempt plus the retry's 2500-token prefill on a loaded 2-core machine.
PREFILL_TIMEOUT_S = 8.0


CHUNK = ("--max-num-batched-tokens", "256")


@pytest.fixture(scope="module")
def workers(llama_dir):
    cluster = Cluster(llama_dir, transfer="tcp")
    try:
        cluster.start_worker("d0", "decode", *CHUNK, "--remote-prefill-threshold", "32",
                             "--prefill-timeout", str(PREFILL_TIMEOUT_S))
        cluster.start_worker("p0", "prefill", *CHUNK)
        cluster.start_worker("p1", "prefill", *CHUNK)
        cluster.wait_workers()
        yield ({name: w.address for name, w in cluster.workers.items()},
               {name: w.proc for name, w in cluster.workers.items()})
    finally:
        cluster.close(grace_s=30.0)
    assert not cluster.killed, "a worker did not stop on SIGTERM"


@pytest.fixture(scope="module")
def expected(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=256, num_threads=1))
    results = engine.generate(list(PROMPTS.values()), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return {name: r.token_ids for name, r in zip(PROMPTS, results)}


def test_sigkill_mid_prefill_retries_the_other_prefill_worker(workers, expected):
    addresses, procs = workers
    d0, p0, p1 = addresses["d0"], addresses["p0"], addresses["p1"]
    out = asyncio.run(generate(d0, "warm", PROMPTS["warm"], MAX_TOKENS, [("p0", p0)]))
    assert out.token_ids == expected["warm"] and out.prefilled_remotely
    before = worker_stats(d0)

    async def killed_mid_prefill():
        task = asyncio.create_task(generate(d0, "killed", PROMPTS["killed"], MAX_TOKENS, [("p0", p0), ("p1", p1)]))
        await wait_running(p0, task, timeout=10)        # p0 is computing the prompt now
        procs["p0"].process.send_signal(signal.SIGKILL)
        return await task

    out = asyncio.run(killed_mid_prefill())
    procs["p0"].process.wait(10)
    assert out.token_ids == expected["killed"] and out.prefilled_remotely       # filled by p1 after p0 died
    after = worker_stats(d0)
    assert after.num_prefill_retries == before.num_prefill_retries + 1
    assert after.num_remote_prefills == before.num_remote_prefills + 1
    assert worker_stats(p1).num_prefills_served == 1
    wait_idle({"d0": d0, "p1": p1}, 1.0)


def test_dead_prefill_workers_fall_back_to_local_prefill(workers, expected):
    addresses, procs = workers
    d0, p0 = addresses["d0"], addresses["p0"]
    assert procs["p0"].process.poll() is not None       # killed by the previous test
    before = worker_stats(d0)
    start = time.monotonic()
    out = asyncio.run(generate(d0, "dead", PROMPTS["dead"], MAX_TOKENS, [("p0", p0)]))
    assert out.token_ids == expected["dead"] and not out.prefilled_remotely
    assert time.monotonic() - start < 3.0      # a refused connection, well before the 8 s deadline
    after = worker_stats(d0)
    assert after.num_prefill_fallbacks == before.num_prefill_fallbacks + 1
    assert after.num_local_prefills == before.num_local_prefills + 1
    # Nothing listens at p0's address: no process can still write, so the blocks are freed at once.
    wait_idle({"d0": d0}, 1.0)
    assert worker_stats(d0).num_fences_confirmed == before.num_fences_confirmed + 1


def test_hung_prefill_worker_is_given_up_at_the_deadline(workers, expected):
    """A peer that accepts connections and never answers: the deadline ends the wait."""
    addresses, _ = workers
    d0 = addresses["d0"]
    with socket.create_server(("127.0.0.1", 0)) as hung:
        address = "127.0.0.1:%d" % hung.getsockname()[1]
        before = worker_stats(d0)
        start = time.monotonic()
        out = asyncio.run(generate(d0, "hung", PROMPTS["hung"], MAX_TOKENS, [("hung", address)]))
        took = time.monotonic() - start
        # The hung peer cannot confirm it stopped writing: the granted blocks stay fenced until
        # the grant is over (the deadline, plus the sender's grace), then go back.
        fenced = worker_stats(d0)
        assert fenced.num_fenced_kv_blocks == -(-len(PROMPTS["hung"]) // 16), fenced
        wait_idle({"d0": d0}, GRANT_GRACE_S + 4.0)     # the peer still hangs meanwhile
    assert out.token_ids == expected["hung"] and not out.prefilled_remotely
    assert PREFILL_TIMEOUT_S - 0.5 < took < PREFILL_TIMEOUT_S + 5
    after = worker_stats(d0)
    assert after.num_prefill_fallbacks == before.num_prefill_fallbacks + 1
    assert after.num_fences_waited_out == before.num_fences_waited_out + 1
    assert after.num_fences_confirmed == before.num_fences_confirmed
