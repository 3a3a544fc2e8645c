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

import grpc
import pytest

from splitserve.proto.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.wire.sampling_params import SamplingParams
from splitserve.services.worker.kv.transfer import GRANT_GRACE_S

from .conftest import Proc, free_port, worker_stats

PROMPTS = {name: [(7 * i + 31 * k) % 31000 + 5 for i in range(n)]
           for k, (name, n) in enumerate([("warm", 100), ("killed", 2500), ("dead", 150), ("hung", 160)])}
MAX_TOKENS = 5
# Covers the killed worker's attempt plus the retry's 2500-token prefill on a loaded 2-core machine.
PREFILL_TIMEOUT_S = 8.0


def _worker(llama_dir, role: str, name: str, *extra: str) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc.start(["splitserve", "worker", "--role", role, "--model", str(llama_dir), "--port", str(port),
                       "--threads", "1", "--kv-cache-gib", "0.05", "--worker-id", name, "--transfer", "tcp",
                       "--max-num-batched-tokens", "256", *extra])
    return proc, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def workers(llama_dir):
    procs = {}
    try:
        procs["d0"] = _worker(llama_dir, "decode", "d0", "--remote-prefill-threshold", "32",
                              "--prefill-timeout", str(PREFILL_TIMEOUT_S))
        procs["p0"] = _worker(llama_dir, "prefill", "p0")
        procs["p1"] = _worker(llama_dir, "prefill", "p1")
        for name, (proc, _) in procs.items():
            proc.wait_for_line(rf"worker {name} ready", 120)
        yield {name: address for name, (_, address) in procs.items()}, {n: p for n, (p, _) in procs.items()}
    finally:
        for proc, _ in procs.values():
            proc.stop()


@pytest.fixture(scope="module")
def expected(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=256, num_threads=1))
    results = engine.generate(list(PROMPTS.values()), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return {name: r.token_ids for name, r in zip(PROMPTS, results)}


def _peer(name: str, address: str) -> worker_pb2.PrefillPeer:
    return worker_pb2.PrefillPeer(worker_id=name, address=address)


async def _generate(decode: str, request_id: str, prompt: list[int], peers: list[worker_pb2.PrefillPeer],
                    on_first=None) -> tuple[list[int], bool]:
    request = worker_pb2.TokenGenerateRequest(
        request_id=request_id, token_ids=prompt,
        params=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        prefill_peer=peers[0], alternate_prefill_peers=peers[1:])
    async with grpc.aio.insecure_channel(decode) as channel:
        replies = [r async for r in worker_pb2_grpc.WorkerStub(channel).Generate(request)]
    return [t for r in replies for t in r.token_ids], replies[0].prefilled_remotely


def _assert_no_leak(addresses: dict[str, str], limit_s: float = 1.0) -> None:
    """Every worker idle within `limit_s` (a given-up reservation's blocks are freed once
    its fence is answered, in the background)."""
    deadline = time.monotonic() + limit_s
    for name, address in addresses.items():
        while True:
            s = worker_stats(address)
            idle = (s.num_used_kv_blocks == 0 and s.num_remote_prefill == 0 and s.num_transfer_reservations == 0
                    and s.num_held_prefills == 0 and s.num_fenced_kv_blocks == 0)
            if idle:
                break
            assert time.monotonic() < deadline, (name, s)
            time.sleep(0.02)


def test_sigkill_mid_prefill_retries_the_other_prefill_worker(workers, expected):
    addresses, procs = workers
    d0, p0, p1 = addresses["d0"], addresses["p0"], addresses["p1"]
    tokens, remote = asyncio.run(_generate(d0, "warm", PROMPTS["warm"], [_peer("p0", p0)]))
    assert tokens == expected["warm"] and remote
    before = worker_stats(d0)

    async def killed_mid_prefill():
        task = asyncio.create_task(_generate(d0, "killed", PROMPTS["killed"], [_peer("p0", p0), _peer("p1", p1)]))
        deadline = time.monotonic() + 10
        while worker_stats(p0).num_running == 0:        # p0 is computing the prompt now
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.01)
        procs["p0"].process.send_signal(signal.SIGKILL)
        return await task

    tokens, remote = asyncio.run(killed_mid_prefill())
    procs["p0"].process.wait(10)
    assert tokens == expected["killed"] and remote       # filled by p1 after p0 died
    after = worker_stats(d0)
    assert after.num_prefill_retries == before.num_prefill_retries + 1
    assert after.num_remote_prefills == before.num_remote_prefills + 1
    assert worker_stats(p1).num_prefills_served == 1
    _assert_no_leak({"d0": d0, "p1": p1})


def test_dead_prefill_workers_fall_back_to_local_prefill(workers, expected):
    addresses, procs = workers
    d0, p0 = addresses["d0"], addresses["p0"]
    assert procs["p0"].process.poll() is not None       # killed by the previous test
    before = worker_stats(d0)
    start = time.monotonic()
    tokens, remote = asyncio.run(_generate(d0, "dead", PROMPTS["dead"], [_peer("p0", p0)]))
    assert tokens == expected["dead"] and not remote
    assert time.monotonic() - start < 3.0      # a refused connection, well before the 8 s deadline
    after = worker_stats(d0)
    assert after.num_prefill_fallbacks == before.num_prefill_fallbacks + 1
    assert after.num_local_prefills == before.num_local_prefills + 1
    # Nothing listens at p0's address: no process can still write, so the blocks are freed at once.
    _assert_no_leak({"d0": d0})
    assert worker_stats(d0).num_fences_confirmed == before.num_fences_confirmed + 1


def test_hung_prefill_worker_is_given_up_at_the_deadline(workers, expected):
    """A peer that accepts connections and never answers: the deadline ends the wait."""
    addresses, _ = workers
    d0 = addresses["d0"]
    with socket.create_server(("127.0.0.1", 0)) as hung:
        address = "127.0.0.1:%d" % hung.getsockname()[1]
        before = worker_stats(d0)
        start = time.monotonic()
        tokens, remote = asyncio.run(_generate(d0, "hung", PROMPTS["hung"], [_peer("hung", address)]))
        took = time.monotonic() - start
        # The hung peer cannot confirm it stopped writing: the granted blocks stay fenced until
        # the grant is over (the deadline, plus the sender's grace), then go back.
        fenced = worker_stats(d0)
        assert fenced.num_fenced_kv_blocks == -(-len(PROMPTS["hung"]) // 16), fenced
        _assert_no_leak({"d0": d0}, limit_s=GRANT_GRACE_S + 4.0)     # the peer still hangs meanwhile
    assert tokens == expected["hung"] and not remote
    assert PREFILL_TIMEOUT_S - 0.5 < took < PREFILL_TIMEOUT_S + 5
    after = worker_stats(d0)
    assert after.num_prefill_fallbacks == before.num_prefill_fallbacks + 1
    assert after.num_fences_waited_out == before.num_fences_waited_out + 1
    assert after.num_fences_confirmed == before.num_fences_confirmed
