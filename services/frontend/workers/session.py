"""The frontend side of a worker session: one connection per worker carries all its requests.

`WorkerSession.generate(message)` reads like a Generate call: the worker's
messages for that request, ending with the finished one, or a `WorkerCallError`
with the status a Generate call would have ended with. Leaving the iteration
early (the client went away) sends an abort for the request. The link is opened
on first use and reopened after it breaks; when it breaks (the worker died, its
channel was closed), every request on it gets a `WorkerCallError` with the
link's status, which the lifecycle treats like a broken Generate stream
(migration).

Two links carry the same SessionRequest/SessionResponse messages:

- `StreamLink`, the worker's session stream (services/worker/session_stream.py),
  when the worker's Describe names a session port. The event loop reads the
  socket itself: one wake-up per message.
- `GrpcLink`, the GenerateSession gRPC call, for workers without one. grpc.aio
  moves each message through two more threads first.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from google.protobuf.message import DecodeError

from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc
from splitserve.services.worker_protocol.framing import FrameBuffer, FrameError, frame

log = logging.getLogger(__name__)

_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
CONNECT_TIMEOUT_S = 10.0


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


class Link(Protocol):
    """One open connection to a worker's session; it reports to its `_Requests`."""

    async def write(self, request: worker_pb2.SessionRequest) -> None:
        """Raises WorkerCallError when the link is down."""

    async def close(self) -> None:
        """Cut the link; its requests fail with CANCELLED."""


LinkOpener = Callable[["_Requests"], Awaitable[Link]]


@dataclass(slots=True, eq=False)
class _Requests:
    """The requests waiting for one link's messages; the link calls `deliver` and `fail`."""

    name: str
    inboxes: dict[str, asyncio.Queue] = field(default_factory=dict)
    failure: WorkerCallError | None = None
    link: Link | None = None

    def deliver(self, response: worker_pb2.SessionResponse) -> None:
        inbox = self.inboxes.get(response.request_id)
        if inbox is not None:
            inbox.put_nowait(response)

    def fail(self, failure: WorkerCallError) -> None:
        if self.failure is not None:
            return
        self.failure = failure
        if self.inboxes:
            log.warning("session with %s broke with %d requests on it: %s", self.name, len(self.inboxes),
                        failure)
        for inbox in self.inboxes.values():
            inbox.put_nowait(failure)


class WorkerSession:
    def __init__(self, open_link: LinkOpener, name: str):
        self._open_link = open_link
        self._name = name
        self._current: _Requests | None = None
        self._opening: asyncio.Lock | None = None

    @classmethod
    def over_grpc(cls, stub: worker_pb2_grpc.WorkerStub, name: str) -> "WorkerSession":
        return cls(lambda requests: GrpcLink.open(stub, requests), name)

    @classmethod
    def over_stream(cls, host: str, port: int, ssl_context: ssl.SSLContext | None,
                    server_hostname: str | None, name: str) -> "WorkerSession":
        return cls(lambda requests: StreamLink.open(host, port, ssl_context, server_hostname, requests), name)

    async def generate(self, message: worker_pb2.TokenGenerateRequest
                       ) -> AsyncIterator[worker_pb2.TokenGenerateResponse]:
        requests = self._current
        if requests is None or requests.failure is not None:
            requests = await self._open()
        request_id = message.request_id
        inbox = requests.inboxes[request_id] = asyncio.Queue()
        ended = False            # the worker is done with it (finished or failed): no abort
        num_open = max(1, message.n)     # samples not finished yet (n > 1: one `finished` each)
        try:
            try:
                await requests.link.write(worker_pb2.SessionRequest(generate=message))
            except WorkerCallError as exc:
                ended = True
                raise requests.failure or exc from None
            while True:
                item = await inbox.get()
                if isinstance(item, WorkerCallError):
                    ended = True
                    raise item
                if item.HasField("error"):
                    ended = True
                    raise WorkerCallError(_STATUS_BY_VALUE.get(item.error.code, grpc.StatusCode.UNKNOWN),
                                          item.error.message)
                num_open -= item.output.finished
                ended = num_open == 0
                yield item.output
                if ended:
                    return
        finally:
            requests.inboxes.pop(request_id, None)
            if not ended and requests.failure is None:
                try:
                    await requests.link.write(worker_pb2.SessionRequest(abort_request_id=request_id))
                except WorkerCallError:
                    pass            # the link is gone, and its requests with it

    async def abort(self, request_id: str) -> None:
        """Stop one sample "<request_id>/<i>" of a request with n > 1 running on this session
        (its `finished` message still comes); nothing when the link is gone."""
        requests = self._current
        if requests is not None and requests.failure is None and requests.link is not None:
            try:
                await requests.link.write(worker_pb2.SessionRequest(abort_request_id=request_id))
            except WorkerCallError:
                pass

    async def close(self) -> None:
        if self._current is not None:
            current, self._current = self._current, None
            current.fail(WorkerCallError(grpc.StatusCode.CANCELLED, f"the session with {self._name} was closed"))
            if current.link is not None:
                await current.link.close()

    async def _open(self) -> _Requests:
        """The current link, or a new one (one opening at a time); raises WorkerCallError."""
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._current is None or self._current.failure is not None:
                requests = _Requests(self._name)
                requests.link = await self._open_link(requests)
                self._current = requests
            return self._current


class GrpcLink:
    """The GenerateSession gRPC call; a reader task hands its messages over."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, requests: _Requests):
        self._call = stub.GenerateSession()
        self._writing = asyncio.Lock()           # one write at a time on a call
        self._requests = requests
        self._reader = asyncio.get_running_loop().create_task(self._read(), name=f"session to {requests.name}")

    @classmethod
    async def open(cls, stub: worker_pb2_grpc.WorkerStub, requests: _Requests) -> "GrpcLink":
        return cls(stub, requests)

    async def write(self, request: worker_pb2.SessionRequest) -> None:
        try:
            async with self._writing:
                await self._call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            raise self._requests.failure or WorkerCallError(
                grpc.StatusCode.UNAVAILABLE, f"the session with {self._requests.name} is closed: {exc}") from None

    async def close(self) -> None:
        self._call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)

    async def _read(self) -> None:
        name = self._requests.name
        try:
            async for response in self._call:
                self._requests.deliver(response)
            failure = WorkerCallError(grpc.StatusCode.UNAVAILABLE, f"{name} ended the session")
        except grpc.aio.AioRpcError as exc:
            failure = WorkerCallError(exc.code(), exc.details() or exc.code().name)
        except asyncio.CancelledError:
            # The call alone was cancelled (its channel was closed: the worker was removed),
            # or this task was (close()); either way the requests on it are cut off.
            failure = WorkerCallError(grpc.StatusCode.CANCELLED, f"the session with {name} was closed")
        self._requests.fail(failure)


class StreamLink(asyncio.Protocol):
    """The worker's session stream: the event loop parses frames straight into the inboxes."""

    def __init__(self, requests: _Requests):
        self._requests = requests
        self._frames = FrameBuffer()
        self._transport: asyncio.Transport | None = None
        self._writable: asyncio.Future | None = None     # set while the transport's buffer is over its limit

    @classmethod
    async def open(cls, host: str, port: int, ssl_context: ssl.SSLContext | None, server_hostname: str | None,
                   requests: _Requests) -> "StreamLink":
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, link = await loop.create_connection(lambda: cls(requests), host, port, ssl=ssl_context,
                                                       server_hostname=server_hostname)
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            failure = WorkerCallError(grpc.StatusCode.UNAVAILABLE,
                                      f"cannot open the session stream to {requests.name} ({host}:{port}): "
                                      f"{exc.strerror if isinstance(exc, OSError) and exc.strerror else exc!r}")
            requests.fail(failure)
            raise failure from None
        return link

    # -- the link --------------------------------------------------------------------
    async def write(self, request: worker_pb2.SessionRequest) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            raise self._requests.failure or WorkerCallError(
                grpc.StatusCode.UNAVAILABLE, f"the session stream to {self._requests.name} is closed")
        transport.write(frame(request.SerializeToString()))
        if self._writable is not None and request.HasField("generate"):
            # A worker that stops reading holds up new requests, not the frontend's memory;
            # aborts are small and never wait (they run while a request is being closed).
            await asyncio.shield(self._writable)
            if self._requests.failure is not None:
                raise self._requests.failure

    async def close(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    # -- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            for payload in self._frames.feed(data):
                self._requests.deliver(worker_pb2.SessionResponse.FromString(payload))
        except (FrameError, DecodeError) as exc:
            self._requests.fail(WorkerCallError(grpc.StatusCode.INTERNAL,
                                                f"{self._requests.name} sent a malformed session frame: {exc}"))
            self._transport.abort()

    def eof_received(self) -> bool:
        return False                 # close our side too; connection_lost reports it

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        self._release_writers()

    def _release_writers(self) -> None:
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        name = self._requests.name
        if exc is None and self._frames.empty:
            failure = WorkerCallError(grpc.StatusCode.UNAVAILABLE, f"{name} ended the session")
        else:
            failure = WorkerCallError(grpc.StatusCode.UNAVAILABLE, f"the session stream to {name} broke: "
                                                                   f"{exc or 'closed mid-message'}")
        self._requests.fail(failure)
        self._release_writers()
