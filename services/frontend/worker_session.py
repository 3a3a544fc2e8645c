"""The frontend side of GenerateSession: one call per worker carries all its requests.

`WorkerSession.generate(message)` reads like a Generate call: the worker's
messages for that request, ending with the finished one, or a `WorkerCallError`
with the status a Generate call would have ended with. Leaving the iteration
early (the client went away) sends an abort for the request. The call is
opened on first use and reopened after it breaks; when it breaks (the worker
died, its channel was closed), every request on it gets a `WorkerCallError`
with the call's status, which the lifecycle treats like a broken Generate
stream (migration).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


class WorkerCallError(Exception):
    """How a request on a session ended badly; `code()` and `details()` as on grpc.aio.AioRpcError."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@dataclass(slots=True, eq=False)
class _Call:
    """One GenerateSession call and the requests waiting for its messages."""

    call: grpc.aio.StreamStreamCall
    inboxes: dict[str, asyncio.Queue] = field(default_factory=dict)
    writing: asyncio.Lock = field(default_factory=asyncio.Lock)   # one write at a time on a call
    failure: WorkerCallError | None = None
    reader: asyncio.Task | None = None

    async def write(self, request: worker_pb2.SessionRequest) -> None:
        async with self.writing:
            await self.call.write(request)


class WorkerSession:
    def __init__(self, stub: worker_pb2_grpc.WorkerStub, name: str):
        self._stub = stub
        self._name = name
        self._current: _Call | None = None

    async def generate(self, message: worker_pb2.TokenGenerateRequest
                       ) -> AsyncIterator[worker_pb2.TokenGenerateResponse]:
        call = self._open()
        request_id = message.request_id
        inbox = call.inboxes[request_id] = asyncio.Queue()
        ended = False            # the worker is done with it (finished or failed): no abort
        try:
            try:
                await call.write(worker_pb2.SessionRequest(generate=message))
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                ended = True
                raise call.failure or WorkerCallError(grpc.StatusCode.UNAVAILABLE,
                                                      f"the session with {self._name} is closed: {exc}") from None
            while True:
                item = await inbox.get()
                if isinstance(item, WorkerCallError):
                    ended = True
                    raise item
                if item.HasField("error"):
                    ended = True
                    raise WorkerCallError(_STATUS_BY_VALUE.get(item.error.code, grpc.StatusCode.UNKNOWN),
                                          item.error.message)
                ended = item.output.finished
                yield item.output
                if ended:
                    return
        finally:
            call.inboxes.pop(request_id, None)
            if not ended and call.failure is None:
                await self._abort(call, request_id)

    async def close(self) -> None:
        if self._current is not None:
            current, self._current = self._current, None
            current.call.cancel()
            if current.reader is not None:
                await asyncio.gather(current.reader, return_exceptions=True)

    def _open(self) -> _Call:
        if self._current is None or self._current.failure is not None:
            current = self._current = _Call(self._stub.GenerateSession())
            current.reader = asyncio.get_running_loop().create_task(self._read(current),
                                                                     name=f"session to {self._name}")
        return self._current

    async def _read(self, current: _Call) -> None:
        try:
            async for response in current.call:
                inbox = current.inboxes.get(response.request_id)
                if inbox is not None:
                    inbox.put_nowait(response)
            failure = WorkerCallError(grpc.StatusCode.UNAVAILABLE, f"{self._name} ended the session")
        except grpc.aio.AioRpcError as exc:
            failure = WorkerCallError(exc.code(), exc.details() or exc.code().name)
        except asyncio.CancelledError:
            # The call alone was cancelled (its channel was closed: the worker was removed),
            # or this task was (close()); either way the requests on it are cut off.
            failure = WorkerCallError(grpc.StatusCode.CANCELLED, f"the session with {self._name} was closed")
        current.failure = failure
        if current.inboxes:
            log.warning("session with %s broke with %d requests on it: %s", self._name, len(current.inboxes),
                        failure)
        for inbox in current.inboxes.values():
            inbox.put_nowait(failure)

    @staticmethod
    async def _abort(call: _Call, request_id: str) -> None:
        try:
            await call.write(worker_pb2.SessionRequest(abort_request_id=request_id))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass            # the call is gone, and its requests with it
