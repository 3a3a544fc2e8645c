"""Stop a grpc.aio server and wait until its calls' tasks are over.

`Server.stop` returns once grpc's core holds no live call, but each call's Python task
(`_schedule_rpc_coro`, named "rpc_task") may still need an event-loop turn to see its
handler end. A process that returns from `asyncio.run` then has that task cancelled by
the loop's clean-up, and grpc logs the cancellation as an unhandled error with a
traceback (a worker leaving after its drain, with a frontend's health Watch open).
"""

from __future__ import annotations

import asyncio

CALLS_END_S = 1.0      # a call's task needs a loop turn or two once its handler returned


async def stop_server(server, grace_s: float | None, calls_end_s: float = CALLS_END_S) -> None:
    """`server.stop(grace_s)`, then wait up to `calls_end_s` for the call tasks still pending."""
    await server.stop(grace_s)
    pending = [task for task in asyncio.all_tasks()
               if not task.done() and getattr(task.get_coro(), "__name__", "") == "_schedule_rpc_coro"]
    if pending:
        await asyncio.wait(pending, timeout=calls_end_s)
