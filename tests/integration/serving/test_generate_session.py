"""Worker sessions against a real `splitserve worker`, through the frontend's WorkerSession over
both links (the session stream and the GenerateSession gRPC call): concurrent requests on one
link, abort, per-request errors, a worker that dies, a drain, and what the stream does with a
client that sends garbage."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import struct
from collections.abc import Callable

import grpc
import pytest

from splitserve.proto.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from splitserve.services.frontend.migration import breaks_stream
from splitserve.services.frontend.workers.session import GrpcLink, StreamLink, WorkerCallError, WorkerSession
from splitserve.services.frontend.workers.pool import WorkerAddress, WorkerPool
from splitserve.testing.waiting import async_wait_until
from splitserve.testing.workers import worker_stats

from .conftest import Proc, free_port

PROMPT = list(range(100, 170))           # 70 tokens: 4 full blocks
LINKS = ["stream", "grpc"]


async def open_session(channel: grpc.aio.Channel, address: str, link: str) -> WorkerSession:
    stub = worker_pb2_grpc.WorkerStub(channel)
    if link == "grpc":
        return WorkerSession.over_grpc(stub, address)
    info = await stub.Describe(worker_pb2.DescribeRequest())
    assert info.session_port, info
    return WorkerSession.over_stream("127.0.0.1", info.session_port, None, None, address)


def start_worker(llama_dir, name: str, *extra: str) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc.start(["splitserve", "worker", "--model", str(llama_dir), "--port", str(port), "--threads", "1",
                       "--kv-cache-gib", "0.05", "--worker-id", name, "--drain-timeout", "1", *extra])
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


async def _until_stats(address: str, done: Callable[[worker_pb2.StatsResponse], bool], what: str,
                       timeout: float = 1.0) -> worker_pb2.StatsResponse:
    """The worker's Stats once `done(stats)`; read off the event loop, whose session must run meanwhile."""
    async def read() -> worker_pb2.StatsResponse | None:
        stats = await asyncio.to_thread(worker_stats, address)
        return stats if done(stats) else None

    return await async_wait_until(read, timeout=timeout, interval=0.02, what=what,
                                  details=lambda: worker_stats(address))


@pytest.mark.parametrize("link", LINKS)
def test_concurrent_requests_on_one_session_match_generate(worker, link):
    async def main():
        async with grpc.aio.insecure_channel(worker) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            session = await open_session(channel, worker, link)
            prompts = [PROMPT, PROMPT[:40], list(range(500, 530))]
            via_session = await asyncio.gather(*(tokens(session.generate(request(f"s{i}", p)))
                                                 for i, p in enumerate(prompts)))
            via_generate = [await tokens(stub.Generate(request(f"g{i}", p))) for i, p in enumerate(prompts)]
            await session.close()
            return via_session, via_generate

    via_session, via_generate = asyncio.run(main())
    assert via_session == via_generate and all(len(t) == 8 for t in via_session)


@pytest.mark.parametrize("link", LINKS)
def test_refusals_end_only_their_request(worker, link):
    async def main():
        async with grpc.aio.insecure_channel(worker) as channel:
            session = await open_session(channel, worker, link)
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


@pytest.mark.parametrize("link", LINKS)
def test_leaving_a_request_early_aborts_it_on_the_worker(worker, link):
    async def main():
        async with grpc.aio.insecure_channel(worker) as channel:
            session = await open_session(channel, worker, link)
            async with contextlib.aclosing(session.generate(request("long", max_tokens=2000))) as responses:
                async for _ in responses:
                    break                       # the client went away after the first message
            stats = await _until_stats(worker, lambda s: s.num_running == 0 and s.num_used_kv_blocks == 0,
                                       "the request to be aborted")
            after = await tokens(session.generate(request("after")))     # the session lives on
            await session.close()
            return stats, after

    stats, after = asyncio.run(main())
    assert stats.num_aborted >= 1 and len(after) == 8


def test_closing_the_stream_aborts_its_requests(worker):
    """A frontend that goes away (its connection closes) leaves nothing running on the worker."""
    async def main():
        async with grpc.aio.insecure_channel(worker) as channel:
            session = await open_session(channel, worker, "stream")
            responses = session.generate(request("orphan", max_tokens=2000))
            await anext(responses)
            await session.close()               # the connection goes; the request was not aborted
            with pytest.raises(WorkerCallError) as cut:
                await anext(responses)
            stats = await _until_stats(worker, lambda s: s.num_running == 0, "nothing to run on the worker")
            return cut.value, stats

    cut, stats = asyncio.run(main())
    assert cut.code() == grpc.StatusCode.CANCELLED and stats.num_used_kv_blocks == 0


def test_the_stream_drops_a_client_that_sends_garbage_and_serves_on(worker):
    async def main():
        async with grpc.aio.insecure_channel(worker) as channel:
            port = (await worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest())).session_port
            replies = []
            for garbage in (struct.pack("<I", 5) + b"\xff" * 5, struct.pack("<I", 2**31)):   # not protobuf; too long
                with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                    raw.sendall(garbage)
                    replies.append(await asyncio.to_thread(raw.recv, 100))     # b"": the worker closed it
            session = await open_session(channel, worker, "stream")
            out = await tokens(session.generate(request("after-garbage")))
            await session.close()
            return replies, out

    replies, out = asyncio.run(main())
    assert replies == [b"", b""] and len(out) == 8


async def generate_through_the_pool(address: str) -> tuple[list[int], type]:
    """What the frontend does: Describe the worker, then send a request over the link it offers."""
    pool = WorkerPool.connect([WorkerAddress("both", address)])
    pool.start()
    try:
        await async_wait_until(pool.all_ready, timeout=30, interval=0.02, what="the pool to have the worker ready")
        worker = pool.workers[0]
        out = await tokens(worker.generate(request("via-pool")))
        return out, type(worker.session._current.link)
    finally:
        await pool.close()


def test_the_frontend_sends_over_the_stream_when_the_worker_has_one(worker):
    out, link = asyncio.run(generate_through_the_pool(worker))
    assert link is StreamLink and len(out) == 8


def test_a_worker_without_a_stream_says_so_and_is_served_over_grpc(llama_dir):
    proc, address = start_worker(llama_dir, "nostream", "--session-port", "-1")
    try:
        with grpc.insecure_channel(address) as channel:
            info = worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=10)
        out, link = asyncio.run(generate_through_the_pool(address))
    finally:
        assert proc.stop() == 0, proc.output
    assert info.session_port == 0 and info.worker_id == "nostream"
    assert link is GrpcLink and len(out) == 8


@pytest.mark.parametrize("link", LINKS)
def test_a_dying_worker_breaks_its_requests_and_a_drain_ends_the_session(llama_dir, link):
    async def stream_until_cut(session: WorkerSession, name: str, received: list[int]) -> WorkerCallError:
        with pytest.raises(WorkerCallError) as cut:
            async for reply in session.generate(request(name, max_tokens=3000)):
                received += reply.token_ids
        return cut.value

    async def main(address: str, proc: Proc, sig: int):
        async with grpc.aio.insecure_channel(address) as channel:
            session = await open_session(channel, address, link)
            received: list[int] = []
            running = asyncio.ensure_future(stream_until_cut(session, "cut", received))
            await async_wait_until(lambda: len(received) >= 3, timeout=30, interval=0.02,
                                   what="the request to be streaming")
            proc.process.send_signal(sig)
            return await asyncio.wait_for(running, 30)

    proc, address = start_worker(llama_dir, f"{link}1")
    killed = asyncio.run(main(address, proc, signal.SIGKILL))
    proc.process.wait(10)
    assert breaks_stream(killed), killed             # migrated by the frontend, not reported

    proc, address = start_worker(llama_dir, f"{link}2")    # SIGTERM: the drain times out (1 s), then fails it
    drained = asyncio.run(main(address, proc, signal.SIGTERM))
    assert proc.stop() == 0 and "Traceback" not in proc.output, proc.output
    assert drained.code() == grpc.StatusCode.UNAVAILABLE and breaks_stream(drained), drained
