"""The worker's session stream: GenerateSession over a plain TCP (or TLS) connection.

A frontend keeps one connection per worker and sends every request over it, as
it would over a GenerateSession call: the same SessionRequest and
SessionResponse messages (framed by wire/framing.py), served by the same
`GenerateSession` (session.py). The difference is on the frontend's side:
grpc.aio hands each message from its event-engine thread to a poller thread
to the event loop, three thread wake-ups per message, where a connection the
loop reads itself costs one (bench/serving.py; the frontend's added latency).

Semantics are GenerateSession's. When the frontend closes the connection or
it breaks, every request still running on it is aborted, as when a
GenerateSession call goes away. After the drain (`end_sessions`) a connection
ends once its requests are done. A frame that does not parse closes the
connection; the worker keeps serving. With a TLS certificate configured the
stream uses the same certificate and CA as the gRPC port (mutual TLS).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError

from splitserve.errors import SplitserveError
from splitserve.proto.v1 import worker_pb2

from splitserve.services.worker.session import GenerateSession
from splitserve.services.worker_protocol.framing import HEADER_BYTES, FrameError, frame, frame_length

if TYPE_CHECKING:
    from splitserve.services.worker.service import WorkerService

log = logging.getLogger(__name__)

WRITE_HIGH_WATER = 4 * 2**20     # wait for the socket beyond this many buffered bytes


class SessionStreamServer:
    def __init__(self, service: WorkerService):
        self.service = service
        self.server: asyncio.Server | None = None
        self.connections: set[asyncio.Task] = set()
        self.port = 0

    @classmethod
    async def start(cls, service: WorkerService, host: str, port: int,
                    ssl_context: ssl.SSLContext | None) -> "SessionStreamServer":
        stream = cls(service)
        try:
            stream.server = await asyncio.start_server(stream._connected, host, port, ssl=ssl_context)
        except OSError as exc:
            raise SplitserveError(f"the session stream cannot listen on {host}:{port}: {exc.strerror} "
                                  "(choose another --session-port)") from None
        stream.port = stream.server.sockets[0].getsockname()[1]
        return stream

    async def close(self) -> None:
        """Stop accepting and cut the connections still open (the worker is exiting)."""
        if self.server is not None:
            self.server.close()
        for task in self.connections:
            task.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.connections.add(task)
        peer = writer.get_extra_info("peername")
        session = GenerateSession(self.service)
        self.service.sessions.add(session)
        lost = False

        async def requests():
            nonlocal lost
            try:
                while True:
                    header = await reader.readexactly(HEADER_BYTES)
                    yield worker_pb2.SessionRequest.FromString(await reader.readexactly(frame_length(header)))
            except (asyncio.IncompleteReadError, OSError):   # OSError: resets, TLS errors
                pass                                   # the frontend closed the connection, or it broke
            except (FrameError, DecodeError) as exc:
                log.warning("session stream from %s: not a session frame (%s); closing it", peer, exc)
            # Unlike the end of a drain, a lost connection aborts what still runs on it.
            lost = True
            task.cancel()

        try:
            async for response in session.run(requests()):
                writer.write(frame(response.SerializeToString()))
                if writer.transport.get_write_buffer_size() > WRITE_HIGH_WATER:
                    await writer.drain()
        except (asyncio.CancelledError, OSError):
            if not lost and not writer.is_closing():
                log.debug("session stream from %s: cut (the worker is stopping)", peer)
        finally:
            self.service.sessions.discard(session)
            self.connections.discard(task)
            writer.close()
