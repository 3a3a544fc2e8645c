"""Disaggregated prefill/decode with tensor-parallel groups on both sides, sizes mismatched or not.

Real `splitserve worker` processes over TCP on the random-weight Llama (2 KV heads,
so TP=2 gives each rank one head): a prefill worker with --tp 2 and one with --tp 1,
a decode worker with --tp 1 and one with --tp 2. Every rank registers its own KV
pool with its own connector; a prefill rank writes its heads into each decode rank
whose heads overlap them. Driven over the worker gRPC API so each request names its
prefill worker:

- TP=2 → TP=1, TP=1 → TP=2 and TP=2 → TP=2: greedy output equals the aggregated TP=1
  engine's token for token, for prompts inside one block, over several blocks and
  over two prefill chunks, and for a prompt whose prefix the decode worker holds
  already (only the uncached blocks move);
- after the requests every worker is idle: no KV block used, no reservation open on
  any rank, no finished prefill still holding blocks;
- a client gone mid-prefill (TP=2 → TP=2): the prefill worker fences the request on
  both ranks and the decode worker frees its granted blocks on that answer;
- the TP=2 prefill worker's rank 0 killed mid-prefill: the TP=2 decode worker
  prefills locally with the same output and keeps no reservation on either rank, and
  the dead group's other rank exits by itself.

One deployment per backend: TCP, and NIXL where its wheel is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

import pytest

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.testing.cluster import Cluster
from splitserve.testing.models import random_prompt
from splitserve.testing.processes import pid_alive
from splitserve.testing.waiting import wait_until
from splitserve.testing.workers import generate, wait_idle, wait_running, worker_stats

MAX_TOKENS = 5
THRESHOLD = 32


PAIRS = [("p2", "d1"), ("p1", "d2"), ("p2", "d2")]


def _prompts(k: int) -> dict[str, list[int]]:
    """Pair k's prompts (fresh ones per pair: a prompt a worker has cached would stay local)."""
    shared = random_prompt(100 * k, 160)      # both workers cache its 10 full blocks with "shared-a"
    return {"one-block": random_prompt(100 * k + 1, 40), "blocks": random_prompt(100 * k + 2, 130),
            "two-chunks": random_prompt(100 * k + 3, 300),
            "shared-a": shared + random_prompt(100 * k + 4, 20), "shared-b": shared + random_prompt(100 * k + 5, 50)}


PROMPTS = {(k, name): prompt for k in range(len(PAIRS)) for name, prompt in _prompts(k).items()}
PROMPTS["killed"] = random_prompt(900, 2500)        # long enough to be mid-prefill when its worker dies
PROMPTS["cancelled"] = random_prompt(901, 2500)     # likewise, when its client goes away


# NIXL is installed by the test command; a missing NIXL fails the nixl cases (no skip).
BACKENDS = ["tcp", "nixl"]


@pytest.fixture(scope="module", params=BACKENDS)
def cluster(request, llama_dir):
    cluster = Cluster(llama_dir, kv_cache_gib=0.02, transfer=request.param)
    decode_args = ("--remote-prefill-threshold", str(THRESHOLD), "--prefill-timeout", "20")
    try:
        for name, role, tp, extra in [("p2", "prefill", 2, ()), ("p1", "prefill", 1, ()),
                                      ("d1", "decode", 1, decode_args), ("d2", "decode", 2, decode_args)]:
            cluster.start_worker(name, role, "--tp", str(tp), "--max-num-batched-tokens", "256", *extra)
        cluster.wait_workers()          # each ready with the transfer backend asked for
        yield cluster
    finally:
        # SIGTERM to all at once (each drains and joins its ranks); one killed by a test is passed over.
        codes = cluster.close(grace_s=60.0)
    assert not cluster.killed, "a worker did not stop on SIGTERM"
    assert codes == [0] * len(codes), cluster.outputs()[-6000:]


@pytest.fixture(scope="module")
def expected(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=512, num_threads=1))
    results = engine.generate(list(PROMPTS.values()), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return {name: r.token_ids for name, r in zip(PROMPTS, results)}


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{p}-to-{d}" for p, d in PAIRS])
def test_greedy_output_equals_aggregated_tp1(cluster, expected, pair):
    prefill_name, decode_name = pair
    prefill, decode = cluster.workers[prefill_name].address, cluster.workers[decode_name].address
    before_p, before_d = worker_stats(prefill), worker_stats(decode)
    num_remote = 0
    for name, prompt in _prompts(PAIRS.index(pair)).items():
        out = asyncio.run(generate(decode, f"{prefill_name}-{decode_name}-{name}", prompt, MAX_TOKENS,
                                   [("p", prefill)]))
        assert out.token_ids == expected[PAIRS.index(pair), name], (pair, name)
        assert out.prefilled_remotely, (pair, name)       # every prompt here has more uncached tokens than the threshold
        num_remote += 1
    after_p, after_d = worker_stats(prefill), worker_stats(decode)
    assert after_d.num_remote_prefills - before_d.num_remote_prefills == num_remote
    assert after_p.num_prefills_served - before_p.num_prefills_served == num_remote
    assert after_d.num_prefill_fallbacks == before_d.num_prefill_fallbacks
    # The shared prefix was served from the decode worker's cache the second time.
    assert after_d.num_prefix_hit_tokens > before_d.num_prefix_hit_tokens
    wait_idle(cluster.workers.values(), 2.0)


async def _mid_prefill(decode: str, prefill: str, name: str) -> asyncio.Task:
    """Start request `name` (its prompt from PROMPTS); return once `prefill` computes it."""
    task = asyncio.create_task(generate(decode, name, PROMPTS[name], MAX_TOKENS, [("p", prefill)]))
    await wait_running(prefill, task)
    return task


def test_cancel_mid_prefill_fences_every_prefill_rank(cluster):
    """The client of a TP=2 → TP=2 request goes away mid-prefill: the decode worker reuses
    its granted blocks (on both ranks) once the prefill worker answered that neither of
    its ranks has a write in flight."""
    p2, d2 = cluster.workers["p2"].address, cluster.workers["d2"].address
    before_p, before_d = worker_stats(p2), worker_stats(d2)

    async def cancelled_mid_prefill():
        task = await _mid_prefill(d2, p2, "cancelled")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(cancelled_mid_prefill())
    wait_idle(cluster.workers.values(), 2.0)
    after_p, after_d = worker_stats(p2), worker_stats(d2)
    assert after_p.num_fences_served == before_p.num_fences_served + 1
    assert after_d.num_fences_confirmed == before_d.num_fences_confirmed + 1
    assert after_d.num_fences_waited_out == before_d.num_fences_waited_out
    assert after_p.num_prefills_served == before_p.num_prefills_served


def test_prefill_group_killed_mid_prefill_falls_back_locally_and_leaks_nothing(cluster, expected):
    """Rank 0 of the TP=2 prefill worker dies mid-prefill: the TP=2 decode worker prefills
    locally with the same output, no decode rank keeps a reservation, and the dead
    group's other rank exits by itself. (Runs last: it kills p2.)"""
    p2, d2 = cluster.workers["p2"].address, cluster.workers["d2"].address
    ranks = cluster.workers["p2"].proc.children()
    assert ranks, "the TP=2 prefill worker has no rank process"

    async def killed_mid_prefill():
        task = await _mid_prefill(d2, p2, "killed")
        assert worker_stats(d2).num_transfer_reservations == 2     # one per decode rank
        cluster.workers["p2"].proc.process.send_signal(signal.SIGKILL)
        return await task

    before_d = worker_stats(d2)
    out = asyncio.run(killed_mid_prefill())
    assert out.token_ids == expected["killed"] and not out.prefilled_remotely
    # Its granted blocks came back at once: the fence found nothing listening where p2 was
    # (its in-flight Prefill call's connection is reset first; a retry is refused).
    wait_idle({"d2": d2}, 2.0)
    after_d = worker_stats(d2)
    assert after_d.num_fences_confirmed == before_d.num_fences_confirmed + 1
    assert after_d.num_fences_waited_out == before_d.num_fences_waited_out
    wait_until(lambda: not any(pid_alive(pid) for pid in ranks), timeout=30,
               what="the dead prefill worker's TP rank to exit by itself")
