"""The frontend's workers: one gRPC channel each, readiness from health, membership in one place.

`WorkerPool` alone adds and removes `WorkerHandle`s: from the static list it
is built with (`splitserve serve` passes the addresses), or by reconciling
against a registry (splitserve/discovery/: static or etcd; Ray's directory) each
time the registry signals a change. When etcd is unreachable the registry
keeps its last members, so the pool keeps them too; worker health still
decides which of them are ready. Everything else that cares about membership
(the router's KV-event subscribers and stats poller, router_feeds.py)
subscribes a `MembershipListener` instead of editing the pool.

Each worker's readiness follows its standard gRPC health `Watch` stream,
reconnecting with capped backoff, and a worker that turns SERVING is asked to
`Describe` itself (model name, context length, session port, block size),
which the frontend validates requests against and sends requests by
(workers/session.py).
"""

from __future__ import annotations

import asyncio
import logging
import contextlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.errors import InvalidRequestError
from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc
from splitserve.discovery import WorkerRecord
from splitserve.tls import PLAINTEXT, TlsConfig

from splitserve.services.frontend.workers.session import WorkerSession

log = logging.getLogger(__name__)

ROLES = ("both", "decode", "prefill")
MAX_BACKOFF_S = 2.0
CLOSE_TIMEOUT_S = 2.0       # a removed worker's channel close, in the background


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
    num_restarts: int = 0                    # times a new instance answered at this address

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

    async def abort_sample(self, request_id: str) -> None:
        """Stop one sample ("<request_id>/<i>") of a request with n > 1 (session.abort)."""
        if self.session is not None:
            await self.session.abort(request_id)

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


class Registry(Protocol):
    """Where workers are listed (splitserve/discovery/static.py, etcd.py; ray_serve/directory.py)."""

    changed: asyncio.Event                  # set on every change of members()

    def members(self) -> dict[str, WorkerRecord]: ...


OPTIONAL_EVENTS = frozenset({"worker_draining"})     # a listener without the method is not told


class MembershipListener(Protocol):
    """Told of every change of the pool's members, in order, once each."""

    def worker_added(self, worker: WorkerHandle) -> None: ...

    def worker_described(self, worker: WorkerHandle) -> None:
        """Its Describe arrived: first, or again after it turned SERVING anew (a restart)."""

    def worker_removed(self, worker: WorkerHandle) -> None: ...

    # Optional (a listener without it is not told): a ready member said NOT_SERVING (it drains:
    # scale-down, deletion, SIGTERM), as opposed to a watch that broke (it died or restarts).
    # def worker_draining(self, worker: WorkerHandle) -> None: ...


class WorkerPool:
    """The members (by address), their health watches, and who is told of changes (module docstring)."""

    def __init__(self, workers: Iterable[WorkerHandle] = (), tls: TlsConfig = PLAINTEXT,
                 registry: Registry | None = None, max_backoff_s: float = MAX_BACKOFF_S,
                 close_timeout_s: float = CLOSE_TIMEOUT_S):
        self.tls = tls                  # mutual TLS to the workers (splitserve/tls.py)
        self.registry = registry
        self.max_backoff_s = max_backoff_s
        self.close_timeout_s = close_timeout_s
        self._members: dict[str, WorkerHandle] = {}       # by address, in the order they joined
        self._watches: dict[str, asyncio.Task] = {}       # each member's health watch, by address
        self._closing: set[asyncio.Task] = set()          # removed members' channels being closed
        self._listeners: list[MembershipListener] = []
        self._follower: asyncio.Task | None = None
        self._started = False
        for w in workers:
            if self._members.setdefault(w.address, w) is not w:
                log.warning("worker %s is listed twice; using it once", w.address)

    @classmethod
    def connect(cls, addresses: list[WorkerAddress], tls: TlsConfig = PLAINTEXT,
                registry: Registry | None = None) -> "WorkerPool":
        return cls([WorkerHandle.connect(a.address, a.role, a.address, tls) for a in addresses], tls, registry)

    @property
    def workers(self) -> tuple[WorkerHandle, ...]:
        """The members now (a snapshot: only the pool changes membership)."""
        return tuple(self._members.values())

    def holds(self, worker: WorkerHandle) -> bool:
        """Whether `worker` (this very handle) is still a member."""
        return self._members.get(worker.address) is worker

    def ready(self, role_filter: str | None = None) -> list[WorkerHandle]:
        return [w for w in self._members.values() if w.ready and w.info is not None
                and (role_filter is None or (w.decodes if role_filter == "decode" else w.role == role_filter))]

    def all_ready(self) -> bool:
        return all(w.ready and w.info is not None for w in self._members.values())

    # -- membership ----------------------------------------------------------------
    def subscribe(self, listener: MembershipListener) -> None:
        """Tell `listener` of every change from now on, after replaying the members it missed."""
        self._listeners.append(listener)
        for w in self._members.values():
            listener.worker_added(w)
            if w.info is not None:
                listener.worker_described(w)

    def unsubscribe(self, listener: MembershipListener) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def _tell(self, event: str, worker: WorkerHandle) -> None:
        for listener in list(self._listeners):
            try:
                handler = getattr(listener, event, None)
                if handler is None and event in OPTIONAL_EVENTS:
                    continue
                handler(worker)
            except Exception:  # noqa: BLE001 - one listener's bug must not stop membership or health
                log.exception("pool: listener %r failed on %s of %s", listener, event, worker.address)

    def start(self) -> None:
        """Watch every member's health; follow the registry, if any. Needs a running loop."""
        self._started = True
        for w in self._members.values():
            self._start_watch(w)
        if self.registry is not None:
            self.registry.changed.clear()
            self.reconcile()
            self._follower = asyncio.create_task(self._follow(), name="pool follows registry")

    async def _follow(self) -> None:
        while True:
            await self.registry.changed.wait()
            self.registry.changed.clear()       # before reading: a change meanwhile sets it again
            try:
                self.reconcile()
            except Exception:  # noqa: BLE001 - following must outlive a bad record or a bug
                log.exception("pool: reconciling against the registry failed; keeping the members")

    def reconcile(self) -> None:
        """Add the registry's workers the pool lacks and remove those it no longer lists (by address)."""
        wanted = {r.address: r for r in self.registry.members().values()}
        for w in [w for address, w in self._members.items() if address not in wanted]:
            log.info("pool: worker %s at %s removed (no longer registered)", w.worker_id, w.address)
            self._remove(w)
        for address, r in wanted.items():
            if address not in self._members:
                log.info("pool: worker %s (%s) at %s added", r.worker_id, r.role, address)
                self._add(WorkerHandle.connect(r.worker_id, r.role, address, self.tls))

    def _add(self, worker: WorkerHandle) -> None:
        self._members[worker.address] = worker
        if self._started:
            self._start_watch(worker)
        self._tell("worker_added", worker)

    def _remove(self, worker: WorkerHandle) -> None:
        del self._members[worker.address]
        watch = self._watches.pop(worker.address, None)
        if watch is not None:
            watch.cancel()
        self._tell("worker_removed", worker)
        # Closed in the background: awaiting a close that cancels calls to a hung peer must
        # not stall reconciling (the worker may register again a moment later).
        task = asyncio.create_task(_bounded(worker.close(), self.close_timeout_s), name=f"close {worker.address}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _start_watch(self, worker: WorkerHandle) -> None:
        self._watches[worker.address] = asyncio.create_task(self._watch(worker), name=f"watch {worker.address}")

    async def close(self) -> None:
        tasks = [*self._watches.values(), *([self._follower] if self._follower else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *self._closing, return_exceptions=True)
        self._watches.clear()
        self._follower = None
        self._started = False
        for worker in self._members.values():
            await worker.close()

    # -- health --------------------------------------------------------------------
    async def _watch(self, worker: WorkerHandle) -> None:
        stub = health_pb2_grpc.HealthStub(worker.channel)
        backoff = 0.1
        while True:
            try:
                async for update in stub.Watch(health_pb2.HealthCheckRequest(service="")):
                    serving = update.status == health_pb2.HealthCheckResponse.SERVING
                    described = serving and not worker.ready
                    if described:
                        await self._describe(worker)
                    self._set_ready(worker, serving, said=True)
                    if described:
                        self._tell("worker_described", worker)
                    backoff = 0.1
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                log.debug("health watch of %s: %s", worker.address, exc.code().name)
            self._set_ready(worker, False)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)

    @staticmethod
    async def _describe(worker: WorkerHandle) -> None:
        """Ask a worker that turned SERVING what it serves. A different instance at the same
        address (restarted) gets a new session: its session port may have changed."""
        info = await worker.stub.Describe(worker_pb2.DescribeRequest(), timeout=10)
        restarted = worker.info is not None and info.instance_id != worker.info.instance_id
        worker.num_restarts += restarted
        if restarted and worker.session is not None:
            session, worker.session = worker.session, None
            await session.close()
        worker.info = info
        worker.worker_id = info.worker_id

    def _set_ready(self, worker: WorkerHandle, ready: bool, said: bool = False) -> None:
        """`said`: the worker's own health update (else its watch broke)."""
        if worker.ready != ready:
            log.info("worker %s (%s) is %s", worker.worker_id, worker.address,
                     "ready" if ready else "not ready")
            worker.ready = ready
            if not ready and said:
                self._tell("worker_draining", worker)


async def _bounded(awaitable, timeout_s: float) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(awaitable, timeout_s)
