"""etcd discovery (client `etcd3aio`): workers register under a prefix with a lease.

EtcdRegistration (the worker side): grant a lease of `ttl_s`, put
`<prefix><worker_id>` = WorkerRecord JSON attached to it, and refresh it every
ttl/3. When etcd is unreachable it keeps retrying; when the lease turns out to
be gone (expired while etcd was away, or revoked) it grants a new one and
registers again. `pause()` stops refreshing without revoking (a hung worker:
the key disappears when the TTL runs out).

EtcdRegistry (the router side): list the prefix, then watch it from the next
revision. When etcd is unreachable the last known members stay (routing
carries on with them; worker health still removes dead ones) and the list is
re-read when etcd answers again, so members that came or went meanwhile are
picked up.

Both take an optional `TlsConfig` (splitserve/tls.py): `ca` verifies etcd's serving
certificate, `cert` + `key` are the client certificate an etcd started with
`--client-cert-auth` requires, `server_name` the name expected in etcd's certificate
when it differs from the host dialled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from etcd3aio import Etcd3Client, EtcdError, prefix_range_end
# etcd3aio's generated stubs (it has no public streaming helpers that fit: see _watch).
from etcd3aio._protobuf import rpc_pb2, rpc_pb2_grpc

from splitserve.discovery import WorkerRecord
from splitserve.tls import PLAINTEXT, TlsConfig

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/splitserve/workers/"
_ERRORS = (EtcdError, grpc.aio.AioRpcError, OSError, asyncio.TimeoutError)


def etcd_client(endpoints: list[str], tls: TlsConfig = PLAINTEXT) -> Etcd3Client:
    """An etcd3aio client, over TLS when `tls` names a CA (and a client certificate when it has one)."""
    if not tls.enabled:
        return Etcd3Client(endpoints, rpc_max_attempts=1)
    material = tls.pem_material()
    return Etcd3Client(endpoints, rpc_max_attempts=1, tls_server_name=tls.server_name, ca_cert=material.ca,
                       cert_chain=material.cert, cert_key=material.key)


class EtcdRegistration:
    def __init__(self, endpoints: list[str], record: WorkerRecord, prefix: str = DEFAULT_PREFIX,
                 ttl_s: int = 10, tls: TlsConfig = PLAINTEXT):
        self.client = etcd_client(endpoints, tls)
        self.record = record
        self.key = (prefix + record.worker_id).encode()
        self.ttl_s = ttl_s
        self.lease_id: int | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.client.connect()
        self._task = asyncio.create_task(self._run(), name=f"etcd registration {self.record.worker_id}")

    def pause(self) -> None:
        """Stop refreshing the lease (tests: a worker that hangs)."""
        if self._task is not None:
            self._task.cancel()

    async def close(self, revoke: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if revoke and self.lease_id is not None:
            with contextlib.suppress(*_ERRORS):
                await self.client.lease.revoke(self.lease_id, timeout=2)
        await self.client.close()

    async def _register(self) -> None:
        lease = await self.client.lease.grant(self.ttl_s, timeout=2)
        await self.client.kv.put(self.key, self.record.to_json(), lease=lease.ID, timeout=2)
        self.lease_id = lease.ID
        log.info("worker %s registered in etcd (lease %x, ttl %d s)", self.record.worker_id, lease.ID, self.ttl_s)

    async def _refresh(self) -> bool:
        """True while the lease lives."""
        reply = await self.client.lease.time_to_live(self.lease_id, timeout=2)
        if reply.TTL <= 0:
            return False

        async def one():
            yield _keepalive_request(self.lease_id)

        call = self.client.lease._stub.LeaseKeepAlive(one(), timeout=2)
        try:
            async for response in call:
                return response.TTL > 0
        finally:
            call.cancel()
        return False

    async def _run(self) -> None:
        interval = max(self.ttl_s / 3, 0.2)
        while True:
            try:
                if self.lease_id is None or not await self._refresh():
                    await self._register()
            except _ERRORS as exc:
                log.warning("worker %s: etcd unreachable (%s); retrying", self.record.worker_id,
                            type(exc).__name__)
            await asyncio.sleep(interval)


async def find_one(endpoints: list[str], prefix: str, tls: TlsConfig = PLAINTEXT) -> WorkerRecord | None:
    """One record registered under `prefix` (the shared KV store registers under
    discovery.KVSTORE_PREFIX), or None when there is none; raises when etcd cannot be reached."""
    client = etcd_client(endpoints, tls)
    await client.connect()
    try:
        key = prefix.encode()
        reply = await client.kv.get(key, prefix_range_end(key), timeout=2)
        return WorkerRecord.from_json(reply.kvs[0].value) if reply.kvs else None
    finally:
        await client.close()


def _keepalive_request(lease_id: int):
    return rpc_pb2.LeaseKeepAliveRequest(ID=lease_id)


class EtcdRegistry:
    def __init__(self, endpoints: list[str], prefix: str = DEFAULT_PREFIX, max_backoff_s: float = 2.0,
                 tls: TlsConfig = PLAINTEXT):
        self.client = etcd_client(endpoints, tls)
        self.prefix = prefix.encode()
        self.max_backoff_s = max_backoff_s
        self._members: dict[str, WorkerRecord] = {}
        self.changed = asyncio.Event()
        self.connected = False
        self._task: asyncio.Task | None = None

    def members(self) -> dict[str, WorkerRecord]:
        return dict(self._members)

    async def start(self) -> None:
        await self.client.connect()
        self._task = asyncio.create_task(self._run(), name="etcd registry")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.client.close()

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            try:
                revision = await self._list()
                self.connected, backoff = True, 0.1
                await self._watch(revision + 1)
            except asyncio.CancelledError:
                raise
            except _ERRORS as exc:
                if self.connected:
                    log.warning("etcd unreachable (%s); routing with the %d last known workers",
                                type(exc).__name__, len(self._members))
                self.connected = False
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)

    async def _list(self) -> int:
        reply = await self.client.kv.get(self.prefix, prefix_range_end(self.prefix), timeout=2)
        members = {}
        for kv in reply.kvs:
            with contextlib.suppress(ValueError, KeyError):
                r = WorkerRecord.from_json(kv.value)
                members[r.worker_id] = r
        if members != self._members:
            self._members = members
            self.changed.set()
        return reply.header.revision

    async def _watch(self, start_revision: int) -> None:
        # A raw watch stream: etcd3aio's helper reconnects forever by itself, and we
        # want to re-list (not resume) after an outage.
        async def requests():
            yield rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(
                key=self.prefix, range_end=prefix_range_end(self.prefix), start_revision=start_revision,
                progress_notify=True))
            await asyncio.Future()

        call = rpc_pb2_grpc.WatchStub(self.client._channel).Watch(requests())
        try:
            async for response in call:
                if response.canceled or response.compact_revision:
                    return           # re-list
                for ev in response.events:
                    self._on_event(ev)
        finally:
            call.cancel()
        raise EtcdError("watch stream ended")

    def _on_event(self, ev) -> None:
        worker_id = ev.kv.key[len(self.prefix):].decode()
        if ev.type == 1:      # DELETE (lease expiry deletes the key)
            if self._members.pop(worker_id, None) is not None:
                log.info("worker %s left (etcd)", worker_id)
                self.changed.set()
            return
        with contextlib.suppress(ValueError, KeyError):
            r = WorkerRecord.from_json(ev.kv.value)
            if self._members.get(worker_id) != r:
                self._members[worker_id] = r
                log.info("worker %s (%s) joined at %s (etcd)", worker_id, r.role, r.address)
                self.changed.set()
