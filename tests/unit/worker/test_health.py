"""WorkerHealthServicer behind a real grpc.aio server on 127.0.0.1: a Watch stream sees the
status change, and once shutdown is entered it gets NOT_SERVING and ends with OK, so that
the server's stop cancels no stream (grpc logs such a cancellation as an unhandled error)."""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.grpc_server_stop import stop_server
from splitserve.services.worker.health import WorkerHealthServicer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_watch_ends_with_ok_after_not_serving_at_shutdown(caplog):
    async def main():
        health = WorkerHealthServicer()
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await health.set("", NOT_SERVING)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                call = stub.Watch(health_pb2.HealthCheckRequest(service=""))
                seen = [(await call.read()).status]
                await health.set("", SERVING)
                seen.append((await call.read()).status)
                await health.enter_graceful_shutdown()
                rest = await asyncio.wait_for(_read_to_end(call), 10)
                code = await call.code()
                late = stub.Watch(health_pb2.HealthCheckRequest(service=""))
                late_seen = await asyncio.wait_for(_read_to_end(late), 10)
                late_code = await late.code()
        finally:
            await server.stop(1.0)
        return seen, rest, code, late_seen, late_code

    with caplog.at_level(logging.ERROR, logger="grpc"):
        seen, rest, code, late_seen, late_code = asyncio.run(main())
    assert seen == [NOT_SERVING, SERVING]
    assert rest and set(rest) == {NOT_SERVING}
    assert code == grpc.StatusCode.OK
    assert late_seen and set(late_seen) == {NOT_SERVING} and late_code == grpc.StatusCode.OK
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def _read_to_end(call) -> list[int]:
    statuses = []
    while (reply := await call.read()) is not grpc.aio.EOF:
        statuses.append(reply.status)
    return statuses


def test_stop_server_leaves_no_call_task_for_the_loops_clean_up():
    """A watcher that goes away as the worker stops (a frontend dropping a deregistered worker):
    grpc's stop can return while that call's task still waits for a loop turn, and the loop's
    clean-up at exit would cancel it (logged by grpc as an unhandled error with a traceback).
    `stop_server` returns only once no such task is left. Repeated: the window is narrow."""
    async def main() -> int:
        health = WorkerHealthServicer()
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await call.read()).status == SERVING
        call.cancel()
        await health.enter_graceful_shutdown()
        await stop_server(server, 2.0)
        left = len(_call_tasks())
        await channel.close()
        return left

    assert [asyncio.run(main()) for _ in range(30)] == [0] * 30


def _call_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if not t.done() and t.get_coro().__name__ == "_schedule_rpc_coro"]
