"""GenerateSession against a real `splitserve worker`, through the frontend's WorkerSession:
concurrent requests on one call, abort, per-request errors, a worker that dies, a drain."""

from __future__ import annotations

import asyncio
import contextlib
import signal

import grpc
import pytest

from splitserve.proto.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from splitserve.services.frontend.migration import breaks_stream
from splitserve.services.frontend.worker_session import WorkerCallError, WorkerSession

from .conftest import Proc, free_port, worker_stats

PROMPT = list(range(100, 170))           # 70 tokens: 4 full blocks


def start_worker(llama_dir, name: str) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc.start(["splitserve", "worker", "--model", str(llama_dir), "--port", str(port), "--threads", "1",
                       "--kv-cache-gib", "0.05", "--worker-id", name, "--drain-timeout", "1"])
    proc.wait_for_line(rf"worker {name} ready", 120)
    return proc, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def worker(llama_dir):
    proc, address = start_worker(llama_dir, "s0")
    try:
        yield address
    finally:
        assert proc.stop() == 0, proc.output
    assert "Traceback" not in proc.output, proc.output


def request(request_id: str, token_ids=PROMPT, **params) -> worker_pb2.TokenGenerateRequest:
    return worker_pb2.TokenGenerateRequest(request_id=request_id, token_ids=token_ids, params=common_pb2.SamplingParams(
        **{"max_tokens": 8, "ignore_eos": True, "temperature": 0, **params}))


async def tokens(responses) -> list[int]:
    return [t async for r in responses for t in r.token_ids]


def test_concurrent_requests_on_one_session_match_generate(worker):
    async def main():
        async with grpc.aio.insecure_channel(worker) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            session = WorkerSession(stub, worker)
            prompts = [PROMPT, PROMPT[:40], list(range(500, 530))]
            via_session = await asyncio.gather(*(tokens(session.generate(request(f"s{i}", p)))
                                                 for i, p in enumerate(prompts)))
            via_generate = [await tokens(stub.Generate(request(f"g{i}", p))) for i, p in enumerate(prompts)]
            await session.close()
            return via_session, via_generate

    via_session, via_generate = asyncio.run(main())
    assert via_session == via_generate and all(len(t) == 8 for t in via_session)


def test_refusals_end_only_their_request(worker):
    async def main():
        async with grpc.aio.insecure_channel(worker) as channel:
            session = WorkerSession(worker_pb2_grpc.WorkerStub(channel), worker)
            good = asyncio.ensure_future(tokens(session.generate(request("ok", max_tokens=30))))
            with pytest.raises(WorkerCallError) as bad:
                await tokens(session.generate(request("bad", token_ids=[1, 2], top_p=1.5)))
            with pytest.raises(WorkerCallError) as nameless:
                await tokens(session.generate(request("")))
            out = await good
            await session.close()
            return bad.value, nameless.value, out

    bad, nameless, out = asyncio.run(main())
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in bad.details() and not breaks_stream(bad)
    assert nameless.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in nameless.details()
    assert len(out) == 30


def test_leaving_a_request_early_aborts_it_on_the_worker(worker):
    async def main():
        async with grpc.aio.insecure_channel(worker) as channel:
            session = WorkerSession(worker_pb2_grpc.WorkerStub(channel), worker)
            async with contextlib.aclosing(session.generate(request("long", max_tokens=2000))) as responses:
                async for _ in responses:
                    break                       # the client went away after the first message
            deadline = asyncio.get_running_loop().time() + 1.0
            while True:
                stats = await asyncio.to_thread(worker_stats, worker)
                if stats.num_running == 0 and stats.num_used_kv_blocks == 0:
                    break
                assert asyncio.get_running_loop().time() < deadline, f"not aborted within 1 s: {stats}"
                await asyncio.sleep(0.02)
            after = await tokens(session.generate(request("after")))     # the session lives on
            await session.close()
            return stats, after

    stats, after = asyncio.run(main())
    assert stats.num_aborted >= 1 and len(after) == 8


def test_a_dying_worker_breaks_its_requests_and_a_drain_ends_the_session(llama_dir):
    async def stream_until_cut(session: WorkerSession, name: str) -> WorkerCallError:
        with pytest.raises(WorkerCallError) as cut:
            await tokens(session.generate(request(name, max_tokens=3000)))
        return cut.value

    async def main(address: str, proc: Proc, sig: int):
        async with grpc.aio.insecure_channel(address) as channel:
            session = WorkerSession(worker_pb2_grpc.WorkerStub(channel), address)
            running = asyncio.ensure_future(stream_until_cut(session, "cut"))
            await asyncio.sleep(0.5)
            proc.process.send_signal(sig)
            return await asyncio.wait_for(running, 30)

    proc, address = start_worker(llama_dir, "s1")
    killed = asyncio.run(main(address, proc, signal.SIGKILL))
    proc.process.wait(10)
    assert breaks_stream(killed), killed             # migrated by the frontend, not reported

    proc, address = start_worker(llama_dir, "s2")    # SIGTERM: the drain times out (1 s), then fails it
    drained = asyncio.run(main(address, proc, signal.SIGTERM))
    assert proc.stop() == 0 and "Traceback" not in proc.output, proc.output
    assert drained.code() == grpc.StatusCode.UNAVAILABLE and breaks_stream(drained), drained
