"""The worker's standard gRPC health service, with Watch streams that end at shutdown.

grpc's own servicer keeps every Watch stream open until the server stops it, and a
stream the server cancels is logged by grpc as an unhandled error. Here, once the
worker enters its shutdown, each Watch sends NOT_SERVING and ends with OK, before
the server stops; a watcher (the frontends' pool) sees NOT_SERVING either way.
"""

from __future__ import annotations

import asyncio
import contextlib

from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer


class WorkerHealthServicer(HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self._ending = asyncio.Event()

    async def enter_graceful_shutdown(self) -> None:
        await super().enter_graceful_shutdown()
        self._ending.set()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context) -> None:
        try:
            await self._watch(request, context)
        except asyncio.CancelledError:
            # The watcher went away (a frontend dropping a worker that deregistered) or the
            # server stopped: the stream is over either way. Raised into grpc, the cancellation
            # takes its error path, which at shutdown logs it as an unhandled error with a traceback.
            return

    async def _watch(self, request: health_pb2.HealthCheckRequest, context) -> None:
        if not self._ending.is_set():
            watch = asyncio.ensure_future(super().Watch(request, context))
            ending = asyncio.ensure_future(self._ending.wait())
            try:
                await asyncio.wait({watch, ending}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (watch, ending):
                    task.cancel()
                await asyncio.gather(watch, ending, return_exceptions=True)
        # Again, for a watch cancelled before it wrote the change; a repeat is harmless.
        with contextlib.suppress(Exception):
            await context.write(health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING))
