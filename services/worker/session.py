"""The worker side of GenerateSession: many Generate requests over one call.

A frontend keeps one session per worker and sends every request over it, so a
request costs one message each way instead of setting up and tearing down a
call (bench/serving.py: about a third of a millisecond of the frontend's added
latency). Each request runs as its own task over the same code as Generate
(`WorkerService.generate`); its messages go into the session's one outbox,
tagged with its request id. An abort cancels the task, exactly as cancelling a
Generate call does (the engine drops the request and frees its blocks). A
request that fails ends with a SessionError carrying the status Generate would
have ended with. When the caller half-closes, the session ends once its
requests are done; when the call goes away, every request still running is
aborted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from splitserve.proto.v1 import worker_pb2


class SessionHost(Protocol):
    """What a session needs of the Worker service (service.py's `WorkerService`)."""

    def generate(self, request_id: str, request: worker_pb2.TokenGenerateRequest
                 ) -> AsyncIterator[worker_pb2.TokenGenerateResponse]: ...

    def abort_choice(self, request_id: str, running: set[str] | dict) -> bool: ...

    def failure_status(self, method: str, request_id: str, exc: BaseException) -> grpc.StatusCode: ...


log = logging.getLogger(__name__)

_END = None     # the outbox's last item: no request is left and none can come


class GenerateSession:
    def __init__(self, service: SessionHost):
        self.service = service
        self.outbox: asyncio.Queue[worker_pb2.SessionResponse | None] = asyncio.Queue()
        self.running: dict[str, asyncio.Task] = {}
        self.reading = True
        self.reader: asyncio.Task | None = None

    async def run(self, requests: AsyncIterator[worker_pb2.SessionRequest]
                  ) -> AsyncIterator[worker_pb2.SessionResponse]:
        self.reader = asyncio.create_task(self._read(requests))
        try:
            while (message := await self.outbox.get()) is not _END:
                yield message
        finally:
            tasks = [self.reader, *self.running.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def end(self) -> None:
        """Admit no more requests; the call ends (OK) once the running ones are done. The worker
        does this after its drain, so that stopping the server does not cut open sessions."""
        if self.reader is not None:
            self.reader.cancel()        # its finally ends the session when nothing runs

    async def _read(self, requests: AsyncIterator[worker_pb2.SessionRequest]) -> None:
        try:
            async for request in requests:
                if request.HasField("generate"):
                    self._start(request.generate)
                elif request.HasField("abort_request_id"):
                    task = self.running.get(request.abort_request_id)
                    if task is not None:
                        task.cancel()
                    else:                # one sample of a request with n > 1, or nothing
                        self.service.abort_choice(request.abort_request_id, self.running)
        finally:
            self.reading = False
            self._end_if_idle()

    def _start(self, request: worker_pb2.TokenGenerateRequest) -> None:
        request_id = request.request_id
        if not request_id or request_id in self.running:
            problem = "needs a request_id" if not request_id else "reuses the id of a running request"
            self._error(request_id, grpc.StatusCode.INVALID_ARGUMENT, f"a GenerateSession request {problem}")
            return
        self.running[request_id] = asyncio.create_task(self._serve(request_id, request),
                                                       name=f"session {request_id}")

    async def _serve(self, request_id: str, request: worker_pb2.TokenGenerateRequest) -> None:
        try:
            async for output in self.service.generate(request_id, request):
                self.outbox.put_nowait(worker_pb2.SessionResponse(request_id=request_id, output=output))
        except asyncio.CancelledError:
            pass                 # aborted, or the session is closing: nothing more is sent for it
        except Exception as exc:
            code = self.service.failure_status("GenerateSession", request_id, exc)
            self._error(request_id, code, str(exc) or type(exc).__name__)
        finally:
            del self.running[request_id]
            self._end_if_idle()

    def _error(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        self.outbox.put_nowait(worker_pb2.SessionResponse(
            request_id=request_id, error=worker_pb2.SessionError(code=code.value[0], message=message)))

    def _end_if_idle(self) -> None:
        if not self.reading and not self.running:
            self.outbox.put_nowait(_END)
