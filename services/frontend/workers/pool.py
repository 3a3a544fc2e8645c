"""The frontend's view of its workers: one gRPC channel each, readiness from health.

Discovery is static here (`splitserve serve` passes the addresses); a cluster
registry feeds the same `WorkerPool` later. Each worker's readiness follows
its standard gRPC health `Watch` stream, reconnecting with capped backoff, and
a worker that turns SERVING is asked to `Describe` itself (model name,
context length, session port), which the frontend validates requests against
and sends requests by (workers/session.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.errors import InvalidRequestError
from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc
from splitserve.tls import PLAINTEXT, TlsConfig

from splitserve.services.frontend.workers.session import WorkerSession

log = logging.getLogger(__name__)

ROLES = ("both", "decode", "prefill")
MAX_BACKOFF_S = 2.0


@dataclass(slots=True, frozen=True)
class WorkerAddress:
    role: str           # both | decode | prefill
    address: str        # host:port

    @classmethod
    def parse(cls, text: str) -> "WorkerAddress":
        """`ROLE=HOST:PORT`, or `HOST:PORT` for an aggregated worker."""
        role, sep, address = text.partition("=")
        if not sep:
            role, address = "both", text
        if role not in ROLES or ":" not in address:
            raise InvalidRequestError(f"bad worker {text!r}: expected ROLE=HOST:PORT with ROLE one of "
                                      f"{', '.join(ROLES)}")
        return cls(role, address)


@dataclass(slots=True)
class WorkerHandle:
    worker_id: str                      # the address until Describe names it
    role: str
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    ready: bool = False
    info: worker_pb2.DescribeResponse | None = None
    session: WorkerSession | None = None     # opened by the first request
    tls: TlsConfig = PLAINTEXT               # the session stream's, as the channel's

    @classmethod
    def connect(cls, worker_id: str, role: str, address: str, tls: TlsConfig) -> "WorkerHandle":
        """A handle with its own channel (opened lazily by grpc) to `address`."""
        channel = tls.aio_channel(address)
        return cls(worker_id, role, address, channel, worker_pb2_grpc.WorkerStub(channel), tls=tls)

    @property
    def decodes(self) -> bool:
        return self.role in ("both", "decode")

    def generate(self, message: worker_pb2.TokenGenerateRequest) -> AsyncIterator[worker_pb2.TokenGenerateResponse]:
        """The worker's messages for one request, over this frontend's session with it."""
        if self.session is None:
            self.session = self._new_session()
        return self.session.generate(message)

    def _new_session(self) -> WorkerSession:
        """Over the worker's session stream when it has one (Describe), else over gRPC."""
        port = self.info.session_port if self.info is not None else 0
        if not port:
            return WorkerSession.over_grpc(self.stub, self.address)
        host = self.address.rpartition(":")[0].strip("[]")
        return WorkerSession.over_stream(host, port, self.tls.client_ssl_context(), self.tls.server_hostname(host),
                                         self.address)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        await self.channel.close()


@dataclass(slots=True)
class WorkerPool:
    workers: list[WorkerHandle] = field(default_factory=list)
    _tasks: list[asyncio.Task] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    tls: TlsConfig = PLAINTEXT          # mutual TLS to the workers (splitserve/tls.py)

    @classmethod
    def connect(cls, addresses: list[WorkerAddress], tls: TlsConfig = PLAINTEXT) -> "WorkerPool":
        pool = cls(tls=tls)
        for a in addresses:
            pool.workers.append(WorkerHandle.connect(a.address, a.role, a.address, tls))
        return pool

    def start(self) -> None:
        for worker in self.workers:
            self._tasks.append(asyncio.create_task(self._watch(worker), name=f"watch {worker.address}"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for worker in self.workers:
            await worker.close()

    def ready(self, role_filter: str | None = None) -> list[WorkerHandle]:
        return [w for w in self.workers if w.ready and w.info is not None
                and (role_filter is None or (w.decodes if role_filter == "decode" else w.role == role_filter))]

    def all_ready(self) -> bool:
        return all(w.ready and w.info is not None for w in self.workers)

    async def _watch(self, worker: WorkerHandle) -> None:
        stub = health_pb2_grpc.HealthStub(worker.channel)
        backoff = 0.1
        while True:
            try:
                async for update in stub.Watch(health_pb2.HealthCheckRequest(service="")):
                    serving = update.status == health_pb2.HealthCheckResponse.SERVING
                    if serving and not worker.ready:
                        await self._describe(worker)
                    self._set_ready(worker, serving)
                    backoff = 0.1
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                log.debug("health watch of %s: %s", worker.address, exc.code().name)
            self._set_ready(worker, False)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    @staticmethod
    async def _describe(worker: WorkerHandle) -> None:
        """Ask a worker that turned SERVING what it serves. A different instance at the same
        address (restarted) gets a new session: its session port may have changed."""
        info = await worker.stub.Describe(worker_pb2.DescribeRequest(), timeout=10)
        if worker.info is not None and info.instance_id != worker.info.instance_id and worker.session is not None:
            session, worker.session = worker.session, None
            await session.close()
        worker.info = info
        worker.worker_id = info.worker_id

    def _set_ready(self, worker: WorkerHandle, ready: bool) -> None:
        if worker.ready != ready:
            log.info("worker %s (%s) is %s", worker.worker_id, worker.address,
                     "ready" if ready else "not ready")
            worker.ready = ready
            self.changed.set()
