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
import random
import signal
import subprocess
import time
from dataclasses import dataclass

import grpc
import pytest

from splitserve.proto.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.wire.sampling_params import SamplingParams

from .conftest import Proc, alive, free_port, worker_stats

MAX_TOKENS = 5
THRESHOLD = 32


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(n)]


PAIRS = [("p2", "d1"), ("p1", "d2"), ("p2", "d2")]


def _prompts(k: int) -> dict[str, list[int]]:
    """Pair k's prompts (fresh ones per pair: a prompt a worker has cached would stay local)."""
    shared = _prompt(100 * k, 160)      # both workers cache its 10 full blocks with "shared-a"
    return {"one-block": _prompt(100 * k + 1, 40), "blocks": _prompt(100 * k + 2, 130),
            "two-chunks": _prompt(100 * k + 3, 300), "shared-a": shared + _prompt(100 * k + 4, 20),
            "shared-b": shared + _prompt(100 * k + 5, 50)}


PROMPTS = {(k, name): prompt for k in range(len(PAIRS)) for name, prompt in _prompts(k).items()}
PROMPTS["killed"] = _prompt(900, 2500)        # long enough to be mid-prefill when its worker dies
PROMPTS["cancelled"] = _prompt(901, 2500)     # likewise, when its client goes away


# NIXL is installed by the test command; a missing NIXL fails the nixl cases (no skip).
BACKENDS = ["tcp", "nixl"]


@dataclass
class Workers:
    addresses: dict[str, str]
    procs: dict[str, Proc]


def _worker(llama_dir, backend: str, role: str, name: str, tp: int, *extra: str) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc.start(["splitserve", "worker", "--role", role, "--model", str(llama_dir), "--port", str(port),
                       "--threads", "1", "--kv-cache-gib", "0.02", "--worker-id", name, "--transfer", backend,
                       "--tp", str(tp), "--max-num-batched-tokens", "256", *extra])
    return proc, f"127.0.0.1:{port}"


@pytest.fixture(scope="module", params=BACKENDS)
def workers(request, llama_dir):
    backend = request.param
    procs = {}
    decode_args = ("--remote-prefill-threshold", str(THRESHOLD), "--prefill-timeout", "20")
    try:
        for name, role, tp, extra in [("p2", "prefill", 2, ()), ("p1", "prefill", 1, ()),
                                      ("d1", "decode", 1, decode_args), ("d2", "decode", 2, decode_args)]:
            procs[name] = _worker(llama_dir, backend, role, name, tp, *extra)
        for name, (proc, _) in procs.items():
            proc.wait_for_line(rf"worker {name} ready \(transfer {backend}\)", 120)
        yield Workers({n: a for n, (_, a) in procs.items()}, {n: p for n, (p, _) in procs.items()})
    finally:
        running = [proc for proc, _ in procs.values() if proc.process.poll() is None]   # not killed by a test
        for proc in running:       # all at once (each drains and joins its ranks), and only once
            proc.process.send_signal(signal.SIGTERM)
        for proc in running:
            try:
                code = proc.process.wait(60)
            except subprocess.TimeoutExpired:
                proc.process.kill()
                raise AssertionError(f"did not stop on SIGTERM:\n{proc.output}") from None
            assert code == 0, proc.output


@pytest.fixture(scope="module")
def expected(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=512, num_threads=1))
    results = engine.generate(list(PROMPTS.values()), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return {name: r.token_ids for name, r in zip(PROMPTS, results)}


async def _generate(decode: str, prefill: str, request_id: str, prompt: list[int]) -> tuple[list[int], bool]:
    request = worker_pb2.TokenGenerateRequest(
        request_id=request_id, token_ids=prompt,
        params=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        prefill_peer=worker_pb2.PrefillPeer(worker_id="p", address=prefill))
    async with grpc.aio.insecure_channel(decode) as channel:
        replies = [r async for r in worker_pb2_grpc.WorkerStub(channel).Generate(request)]
    return [t for r in replies for t in r.token_ids], replies[0].prefilled_remotely


def _idle(s) -> bool:
    return (s.num_used_kv_blocks == 0 and s.num_running == 0 and s.num_waiting == 0 and s.num_remote_prefill == 0
            and s.num_transfer_reservations == 0 and s.num_held_prefills == 0 and s.num_fenced_kv_blocks == 0)


def _assert_all_idle(addresses: dict[str, str], limit_s: float = 2.0) -> None:
    deadline = time.monotonic() + limit_s
    while True:
        stats = {name: worker_stats(address) for name, address in addresses.items()}
        if all(_idle(s) for s in stats.values()):
            return
        assert time.monotonic() < deadline, f"workers not idle: {stats}"
        time.sleep(0.02)


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{p}-to-{d}" for p, d in PAIRS])
def test_greedy_output_equals_aggregated_tp1(workers, expected, pair):
    prefill_name, decode_name = pair
    prefill, decode = workers.addresses[prefill_name], workers.addresses[decode_name]
    before_p, before_d = worker_stats(prefill), worker_stats(decode)
    num_remote = 0
    for name, prompt in _prompts(PAIRS.index(pair)).items():
        tokens, remote = asyncio.run(_generate(decode, prefill, f"{prefill_name}-{decode_name}-{name}", prompt))
        assert tokens == expected[PAIRS.index(pair), name], (pair, name)
        assert remote, (pair, name)       # every prompt here has more uncached tokens than the threshold
        num_remote += 1
    after_p, after_d = worker_stats(prefill), worker_stats(decode)
    assert after_d.num_remote_prefills - before_d.num_remote_prefills == num_remote
    assert after_p.num_prefills_served - before_p.num_prefills_served == num_remote
    assert after_d.num_prefill_fallbacks == before_d.num_prefill_fallbacks
    # The shared prefix was served from the decode worker's cache the second time.
    assert after_d.num_prefix_hit_tokens > before_d.num_prefix_hit_tokens
    _assert_all_idle(workers.addresses)


async def _mid_prefill(decode: str, prefill: str, name: str) -> asyncio.Task:
    """Start request `name` (its prompt from PROMPTS); return once `prefill` computes it."""
    task = asyncio.create_task(_generate(decode, prefill, name, PROMPTS[name]))
    deadline = time.monotonic() + 30
    while worker_stats(prefill).num_running == 0:
        assert time.monotonic() < deadline and not task.done()
        await asyncio.sleep(0.01)
    return task


def test_cancel_mid_prefill_fences_every_prefill_rank(workers):
    """The client of a TP=2 → TP=2 request goes away mid-prefill: the decode worker reuses
    its granted blocks (on both ranks) once the prefill worker answered that neither of
    its ranks has a write in flight."""
    p2, d2 = workers.addresses["p2"], workers.addresses["d2"]
    before_p, before_d = worker_stats(p2), worker_stats(d2)

    async def cancelled_mid_prefill():
        task = await _mid_prefill(d2, p2, "cancelled")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(cancelled_mid_prefill())
    _assert_all_idle(workers.addresses)
    after_p, after_d = worker_stats(p2), worker_stats(d2)
    assert after_p.num_fences_served == before_p.num_fences_served + 1
    assert after_d.num_fences_confirmed == before_d.num_fences_confirmed + 1
    assert after_d.num_fences_waited_out == before_d.num_fences_waited_out
    assert after_p.num_prefills_served == before_p.num_prefills_served


def test_prefill_group_killed_mid_prefill_falls_back_locally_and_leaks_nothing(workers, expected):
    """Rank 0 of the TP=2 prefill worker dies mid-prefill: the TP=2 decode worker prefills
    locally with the same output, no decode rank keeps a reservation, and the dead
    group's other rank exits by itself. (Runs last: it kills p2.)"""
    p2, d2 = workers.addresses["p2"], workers.addresses["d2"]
    ranks = workers.procs["p2"].children()
    assert ranks, "the TP=2 prefill worker has no rank process"

    async def killed_mid_prefill():
        task = await _mid_prefill(d2, p2, "killed")
        assert worker_stats(d2).num_transfer_reservations == 2     # one per decode rank
        workers.procs["p2"].process.send_signal(signal.SIGKILL)
        return await task

    before_d = worker_stats(d2)
    tokens, remote = asyncio.run(killed_mid_prefill())
    assert tokens == expected["killed"] and not remote
    # Its granted blocks came back at once: the fence found nothing listening where p2 was
    # (its in-flight Prefill call's connection is reset first; a retry is refused).
    _assert_all_idle({"d2": d2})
    after_d = worker_stats(d2)
    assert after_d.num_fences_confirmed == before_d.num_fences_confirmed + 1
    assert after_d.num_fences_waited_out == before_d.num_fences_waited_out
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in ranks):
        assert time.monotonic() < deadline, "the dead prefill worker's TP rank is still running"
        time.sleep(0.1)
