"""`splitserve kvstore`: the shared KV block store, as one process.

The store holds KV blocks of one layout (model, dtype, block size, KV heads: set by the
first worker that attaches) in a pool of `--capacity-gib`, indexed by the same chained
content hash the router and the engines use (block_table.py). Workers publish the blocks
they compute and fetch the prefixes they miss (the built-in engine's kv_tiers/store_client.py); the
bytes move over kvtransfer, exactly like a remote prefill's:

- publish (`Offer`): the store grants slots for the blocks it lacks (evicting least recently
  used ones no fetch is reading); the worker WRITEs every layer of them into those slots and
  notifies; the store then checks each block's CRC-32 against the one offered, and only a
  block that matches is served. A publish whose writes never complete frees its slots when
  the grant expires.
- fetch (`Fetch`): the worker grants blocks of its staging pool; the store pins the leading
  blocks it holds, WRITEs every layer of them, notifies, and answers with each block's CRC-32,
  which the worker checks before it uses a byte.

One `RankTransfer` (the workers' own transfer code) drives the store's connector in both
directions. gRPC is the control path (proto/splitserve/v1/kvstore.proto); the standard health
service says SERVING once the server listens. SIGTERM or SIGINT stops it; what it held is gone
(workers count the failed fetches and recompute).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitserve.errors import SplitserveError
from splitserve.grpc_server_stop import stop_server
from splitserve.kvtransfer import AgentMetadata, KVLayout, make_connector
from splitserve.kvtransfer.errors import TransferError
from splitserve.kvtransfer.memory import empty_pool
from splitserve.proto.v1 import kvstore_pb2 as pb
from splitserve.discovery import KVSTORE_PREFIX
from splitserve.proto.v1 import kvstore_pb2_grpc
from splitserve.kvtransfer.block_codec import block_crc
from splitserve.kvtransfer.sender_receiver import LayerReady
from splitserve.kvtransfer.rank_transfer import RankTransfer
from splitserve.kvtransfer.sender_receiver import TransferEndpoint, TransferGrant, TransferTarget
from splitserve.tls import PLAINTEXT, TlsConfig

from splitserve.services.kvstore.block_table import StoreBlockTable

log = logging.getLogger(__name__)

GIB = 1 << 30
AGENT_NAME = "kvstore"
PUBLISH_TTL_S = 10.0         # a publisher's grant: its writes must land within this
FETCH_WAIT_S = 10.0          # the longest a Fetch waits for its writes to complete
MAX_BLOCKS_PER_CALL = 4096


@dataclass(slots=True)
class KVStoreConfig:
    capacity_gib: float = 1.0
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None     # what workers dial for TCP transfers; None: host
    transfer: str = "auto"                # auto | nixl | tcp (the workers' backend must match)
    transfer_token: bytes = b""
    fault_fetch_delay_s: float = 0.0      # fault injection for tests: stall each Fetch this long after pinning
    etcd: list[str] = field(default_factory=list)     # register here (leased) so workers find it: --kv-store etcd
    etcd_prefix: str = KVSTORE_PREFIX
    etcd_tls: TlsConfig = PLAINTEXT
    metrics_port: int | None = None       # GET /metrics (Prometheus) on host:metrics_port; None: off


class KVStoreService(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, config: KVStoreConfig):
        self.config = config
        self.counters: Counter = Counter()
        self.transfer: RankTransfer | None = None
        self.table: StoreBlockTable | None = None
        self.layout: KVLayout | None = None
        self.pool = None
        self._lock = threading.Lock()         # the table: gRPC handlers and the transfer driver's callbacks
        self._attach_lock = asyncio.Lock()

    # -- handshake ------------------------------------------------------------------------
    async def Attach(self, request, context):
        try:
            meta = AgentMetadata.from_bytes(request.agent_metadata)
        except (ValueError, KeyError, TypeError) as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unreadable agent metadata: {error}")
        if meta.layout.tp_size != 1:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "the store holds whole blocks: tensor-parallel workers cannot attach yet")
        async with self._attach_lock:
            if self.transfer is None:
                try:
                    await asyncio.to_thread(self._create, meta.layout, meta.backend)
                except (ValueError, TransferError, SplitserveError) as error:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        try:
            self.transfer.connector.add_peer(meta)
        except TransferError as error:        # another layout, backend or token
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this store cannot serve {meta.name}: {error}")
        self.counters["attached"] += 1
        log.info("kvstore: %s attached (incarnation %s)", meta.name, meta.incarnation[:12])
        return pb.AttachStoreResponse(agent_metadata=self.transfer.metadata.to_bytes(),
                                      capacity_blocks=self.table.capacity)

    def _create(self, layout: KVLayout, backend: str) -> None:
        wanted = self.config.transfer
        if wanted not in ("auto", backend):
            raise SplitserveError(f"this store moves blocks over {wanted}; the worker uses {backend}")
        block_bytes = 2 * layout.num_layers * layout.block_bytes
        capacity = int(self.config.capacity_gib * GIB) // block_bytes
        if capacity < 1:
            raise SplitserveError(f"--capacity-gib {self.config.capacity_gib} holds no block of "
                                  f"{block_bytes} bytes")
        kwargs = {"token": self.config.transfer_token}
        if backend == "tcp":
            kwargs.update(host=self.config.host, advertise_host=self.config.advertise_host)
        connector = make_connector(backend, AGENT_NAME, layout, **kwargs)
        try:
            self.pool = empty_pool(layout.pool_shape(capacity), layout.torch_dtype)
            connector.register(self.pool)
        except BaseException:
            connector.close()
            raise
        self.layout, self.table = layout, StoreBlockTable(capacity)
        self.transfer = RankTransfer(connector, layout.block_size)
        log.info("kvstore: holding %s (%s, block %d, %d bytes a block) in %d slots over %s", layout.model,
                 layout.dtype, layout.block_size, block_bytes, capacity, backend)
        print(f"kvstore: {capacity} blocks of {layout.model} ({block_bytes} bytes each) over {backend}", flush=True)

    async def _require_attached(self, context, agent_name: str = "") -> None:
        if self.transfer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no worker has attached (call Attach first)")
        if agent_name and self.transfer.connector.peer(agent_name) is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{agent_name} has not attached")

    # -- lookup ---------------------------------------------------------------------------
    async def Lookup(self, request, context):
        if self.table is None:
            return pb.LookupBlocksResponse(num_held=0)
        with self._lock:
            held = self.table.lookup(list(request.block_hashes[:MAX_BLOCKS_PER_CALL]))
        self.counters["lookups"] += 1
        return pb.LookupBlocksResponse(num_held=held, blocks_held=len(self.table), capacity_blocks=self.table.capacity,
                                       incarnation=self.transfer.metadata.incarnation)

    # -- publish --------------------------------------------------------------------------
    async def Offer(self, request, context):
        await self._require_attached(context, request.agent_name)
        hashes, crcs = list(request.block_hashes), list(request.crcs)
        if (not request.request_id or len(hashes) != len(crcs) or len(hashes) > MAX_BLOCKS_PER_CALL
                or any(len(h) != 32 for h in hashes)):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "an offer has a request id and up to 4096 (32-byte hash, CRC) pairs")
        with self._lock:
            reserved = self.table.reserve(hashes)
        self.counters["offered"] += len(hashes)
        self.counters["evicted"] += len(reserved.evicted)
        reply = pb.OfferBlocksResponse(wanted=reserved.wanted, slot_ids=reserved.slots, evicted=reserved.evicted)
        if not reserved.wanted:
            return reply
        rid = request.request_id      # the publisher's writes carry it: unique per publisher (its agent name)
        wanted = [(hashes[i], crcs[i], slot) for i, slot in zip(reserved.wanted, reserved.slots)]
        try:
            grant = self.transfer.expect(rid, reserved.slots, PUBLISH_TTL_S)
            self.transfer.watch(rid, lambda payload, error: self._published(rid, wanted, error))
        except TransferError as error:
            self._abort_publish(wanted)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot grant slots: {error}")
        reply.incarnation, reply.deadline_unix = grant.incarnation, grant.deadline_unix
        return reply

    def _published(self, rid: str, wanted: list[tuple[bytes, int, int]], error: TransferError | None) -> None:
        """Transfer driver thread: the publisher's notification (or its failure)."""
        self.transfer.release(rid)
        if error is not None:
            self.counters["publish_failed"] += len(wanted)
            self._abort_publish(wanted)
            return
        for block_hash, crc, slot in wanted:
            ok = block_crc(self.pool, slot) == crc
            with self._lock:
                if ok:
                    self.table.commit(block_hash, crc)
                else:
                    self.table.abort(block_hash)
            self.counters["stored" if ok else "rejected_corrupt"] += 1

    def _abort_publish(self, wanted: list[tuple[bytes, int, int]]) -> None:
        with self._lock:
            for block_hash, _, _ in wanted:
                self.table.abort(block_hash)

    # -- fetch ----------------------------------------------------------------------------
    async def Fetch(self, request, context):
        await self._require_attached(context, request.agent_name)
        hashes, dst = list(request.block_hashes), list(request.block_ids)
        if not request.request_id or len(hashes) != len(dst) or len(hashes) > MAX_BLOCKS_PER_CALL:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "a fetch has a request id and one destination block per hash, up to 4096")
        with self._lock:
            pinned = self.table.pin(hashes)
        self.counters["fetches"] += 1
        if not pinned:
            return pb.FetchBlocksResponse(num_blocks=0)
        slots = [slot for slot, _ in pinned]
        try:
            if self.config.fault_fetch_delay_s:
                print(f"kvstore: fetch {request.request_id}: {len(slots)} blocks pinned; stalling "
                      f"{self.config.fault_fetch_delay_s:g} s (fault injection)", flush=True)
                await asyncio.sleep(self.config.fault_fetch_delay_s)
            await self._send(request, slots, dst[:len(slots)])
        except TransferError as error:
            self.counters["fetch_failed"] += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"fetch failed: {error}")
        finally:
            with self._lock:
                self.table.unpin(slots)
        self.counters["fetched_blocks"] += len(slots)
        return pb.FetchBlocksResponse(num_blocks=len(slots), crcs=[crc for _, crc in pinned])

    async def _send(self, request, slots: list[int], dst: list[int]) -> None:
        bs = self.layout.block_size
        target = TransferTarget(TransferEndpoint(request.agent_name, b"", b""), dst, 0,
                                TransferGrant(request.incarnation, request.deadline_unix))
        t = self.transfer
        t.begin(request.request_id, target, len(dst) * bs, notify=True)
        for layer in range(self.layout.num_layers):
            t.on_layer_ready(LayerReady(request.request_id, layer, 0, slots, len(dst) * bs))
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def on_done(_payload, error) -> None:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(error))

        t.close_send(request.request_id, b"", on_done)
        try:
            error = await asyncio.wait_for(done, FETCH_WAIT_S)
        except TimeoutError:
            t.abandon(request.request_id)
            raise TransferError(f"fetch {request.request_id}: the writes did not complete in {FETCH_WAIT_S} s") from None
        if error is not None:
            raise error

    # -- stats ----------------------------------------------------------------------------
    async def Stats(self, request, context):
        return self.stats()

    def stats(self) -> pb.StoreStatsResponse:
        t, lay = self.table, self.layout
        return pb.StoreStatsResponse(
            blocks_held=len(t) if t else 0, capacity_blocks=t.capacity if t else 0,
            block_bytes=2 * lay.num_layers * lay.block_bytes if lay else 0, counters=dict(self.counters),
            layout=f"{lay.model} {lay.dtype} block {lay.block_size}" if lay else "")

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.close()


async def serve(config: KVStoreConfig, stop: asyncio.Event | None = None) -> int:
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 16 << 20),
                                      ("grpc.max_send_message_length", 16 << 20)])
    service = KVStoreService(config)
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise SplitserveError(f"kvstore: cannot listen on {config.host}:{config.port}")
    await server.start()
    for name in ("", "splitserve.v1.KVStore"):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    started = time.monotonic()
    print(f"kvstore listening on {config.host}:{port} ({config.capacity_gib:g} GiB)", flush=True)
    registration = await _register(config, port)
    metrics = await _serve_metrics(config, service)
    try:
        await stop.wait()
    finally:
        if metrics is not None:
            await metrics.close()
        if registration is not None:
            await registration.close()
        await health_servicer.enter_graceful_shutdown()
        await stop_server(server, 1.0)
        service.close()
        s = service.counters
        log.info("kvstore: stopping after %.0f s: %d blocks stored, %d fetched", time.monotonic() - started,
                 s["stored"], s["fetched_blocks"])
    return 0


async def _register(config: KVStoreConfig, port: int):
    """A leased etcd key under `etcd_prefix` (workers started with `--kv-store etcd` look there)."""
    if not config.etcd:
        return None
    from splitserve.discovery import WorkerRecord
    from splitserve.discovery.etcd import EtcdRegistration

    host = config.advertise_host or config.host
    if host in ("0.0.0.0", "::", ""):
        raise SplitserveError("kvstore: --host listens on every interface; give --advertise-host to register in etcd")
    registration = EtcdRegistration(config.etcd, WorkerRecord(AGENT_NAME, "kvstore", f"{host}:{port}"),
                                    config.etcd_prefix, tls=config.etcd_tls)
    await registration.start()
    return registration


class StoreCollector:
    """The store's Stats as Prometheus families: occupancy gauges and one counter per event."""

    def __init__(self, service: KVStoreService):
        self.service = service

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.service.stats()
        for name, value, text in (("blocks", s.blocks_held, "Blocks the store holds"),
                                  ("capacity_blocks", s.capacity_blocks, "Blocks the store can hold"),
                                  ("block_bytes", s.block_bytes, "Bytes of one block (all layers, K and V)")):
            yield GaugeMetricFamily(f"splitserve_kvstore_{name}", text, value=value)
        events = CounterMetricFamily("splitserve_kvstore_events", "Store events: blocks offered, stored, "
                                     "fetched (fetched_blocks), evicted, rejected_corrupt, publish_failed; calls "
                                     "(lookups, fetches, attached, fetch_failed)", labels=["event"])
        for event, value in sorted(s.counters.items()):
            events.add_metric([event], value)
        yield events


async def _serve_metrics(config: KVStoreConfig, service: KVStoreService):
    if config.metrics_port is None:
        return None
    from splitserve.metrics_http import MetricsApp, MetricsServer

    server = await MetricsServer.start(MetricsApp(registry=StoreCollector(service)), config.host,
                                       config.metrics_port)
    print(f"kvstore metrics on http://{config.host}:{server.port}/metrics", flush=True)
    return server
