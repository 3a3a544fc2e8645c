"""`splitserve worker`: the gRPC server around one engine.

The server starts first and reports NOT_SERVING through the standard health
service while the model loads (on a thread, so health checks are answered
meanwhile); SERVING once the engine is attached. SIGTERM or SIGINT drains (shutdown.py):
admission stops, running calls get up to --drain-timeout to finish, the etcd
registration is revoked, whatever still runs is failed so that its frontend
migrates it, and the process exits 0. A tensor-parallel worker whose group is lost
(a rank is gone, a step failed) stops that way at once and exits 1, so that the
group is replaced as a unit. With --metrics-port the worker also serves
Prometheus metrics over HTTP from the start (stats_metrics.py, served by splitserve/metrics_http.py), until it exits. Beside
the gRPC port the worker listens for frontends' session streams (session_stream.py;
--session-port, any free port by default), whose port Describe tells.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.errors import SplitserveError
from splitserve.grpc_server_stop import stop_server
from splitserve.proto.v1 import worker_pb2_grpc
from splitserve.startup import process_age_s
from splitserve.stop_signals import handle_stop_signals, ignore_stop_signals
from splitserve.services.engine_api.contract import Engine, EngineLauncher, KVStoreSettings, TransferSettings
from splitserve.tls import PLAINTEXT, TlsConfig
from splitserve.tracing import start_tracer

from splitserve.services.worker.health import WorkerHealthServicer
from splitserve.services.worker.service import Role, WorkerOptions, WorkerService
from splitserve.services.worker.session_stream import SessionStreamServer
from splitserve.services.worker.shutdown import drain
from splitserve.kvtransfer.sender_receiver import KVReceiver, KVSender, UnwiredTransfer
from splitserve.services.worker.kv.handoff import HandoffTransfer

if TYPE_CHECKING:
    from splitserve.metrics_http import MetricsServer

log = logging.getLogger(__name__)

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")

MAX_MESSAGE_BYTES = 64 * 2**20
GRPC_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
STATS_TIMEOUT_S = 5.0       # a scrape waits this long for the engine thread (one long step), then omits Stats


@dataclass(slots=True)
class WorkerServerConfig:
    options: WorkerOptions
    engine: EngineLauncher     # loads the engine (services/engine/builtin.py: BuiltinEngineLauncher)
    host: str = "127.0.0.1"
    advertise_host: str | None = None     # the address registered in etcd; None: host
    port: int = 0
    grace_s: float = 2.0     # after the drain: the server's grace period for the calls' last messages
    drain_timeout_s: float = 30.0   # on SIGTERM: running calls get this long to finish (shutdown.py)
    transfer: str = "auto"   # KV transfer backend for the prefill/decode roles: auto | nixl | tcp
    etcd: list[str] = field(default_factory=list)     # register here (with a lease) once serving
    etcd_prefix: str = "/splitserve/workers/"
    etcd_ttl_s: int = 10
    etcd_tls: TlsConfig = PLAINTEXT                   # client TLS to etcd (CA, client certificate)
    transfer_token: bytes = b""   # KV transfer peers must prove this shared secret (kvtransfer/auth.py)
    metrics_port: int | None = None   # serve GET /metrics over HTTP on host:metrics_port (0: any); None: off
    session_port: int | None = 0      # the session stream on host:session_port (0: any); None: off
    kv_store: str | None = None       # the shared KV block store's HOST:PORT (`splitserve kvstore`); None: none


def transfer_settings(config: WorkerServerConfig) -> TransferSettings:
    return TransferSettings(config.transfer, config.options.worker_id, config.host, config.transfer_token,
                            config.advertise_host)


def build_transfer(role: Role, engine: Engine, settings: TransferSettings = TransferSettings()
                   ) -> tuple[KVSender, KVReceiver]:
    """(sender, receiver) for this role, built once the engine's KV memory exists (the engine
    registers it with its connectors before any peer can fetch their metadata).

    Prefill and decode workers get the engine's KV transfer (both halves), or `HandoffTransfer`
    when the engine's own connector moves the KV; an aggregated worker (role both) gets
    `UnwiredTransfer`, which refuses transfers clearly.
    """
    if role is Role.BOTH:
        unwired = UnwiredTransfer()
        return unwired, unwired
    described = engine.describe()
    if described.kv_handoff:            # the engine's own connector moves the KV (kv/handoff.py)
        handoff = HandoffTransfer(described.kv_handoff, described.block_hash_extra_key)
        return handoff, handoff
    transfer = engine.build_kv_transfer(settings)
    return transfer, transfer


async def serve(config: WorkerServerConfig, stop: asyncio.Event | None = None,
                handle_signals: bool = True) -> int:
    """Run until `stop` is set or (with `handle_signals`, main thread only) a SIGTERM/SIGINT
    arrives; returns an exit code. Embedders that own the signals (a Ray replica) pass False."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    if handle_signals:
        handle_stop_signals(loop, stop)
    wid = config.options.worker_id
    server = grpc.aio.server(options=GRPC_OPTIONS)
    health = WorkerHealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    tracer = start_tracer("splitserve-worker", config.options.otlp_traces_endpoint, config.options.worker_id)
    if tracer is not None:
        print(f"worker {wid} exporting traces to {config.options.otlp_traces_endpoint} (OTLP/gRPC)", flush=True)
    service = WorkerService(config.options, health, tracer)
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    address = f"{config.host}:{config.port}"
    port = config.options.tls.add_port(server, address)   # mutual TLS when a certificate is configured
    if port == 0:
        raise SplitserveError(f"worker {wid}: cannot listen on {address}")
    for name in ("", "splitserve.v1.Worker"):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    started = process_age_s()              # interpreter start and imports
    log.info("worker %s (%s): listening on %s:%d, loading %s", wid, config.options.role.value,
             config.host, port, config.engine.model)
    print(f"worker {wid} listening on {config.host}:{port}", flush=True)
    engine = None
    metrics = None
    stream = None
    try:
        metrics = await _serve_metrics(config, service)
        stream = await _serve_session_stream(config, service)
        t_load = time.monotonic()
        load = asyncio.ensure_future(asyncio.to_thread(config.engine.launch))
        waiter = asyncio.ensure_future(stop.wait())
        await asyncio.wait({load, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if not load.done():
            log.info("worker %s: stopped while loading", wid)
            return 0
        waiter.cancel()
        engine = load.result()
        t_transfer = time.monotonic()
        settings = transfer_settings(config)
        sender, receiver = await asyncio.to_thread(build_transfer, config.options.role, engine, settings)
        if config.kv_store:
            await asyncio.to_thread(attach_store, config, engine, settings)
        await service.attach(engine, sender, receiver)
        described = engine.describe()
        log.info("worker %s: serving %s (max_model_len %d, %d KV blocks, transfer %s)", wid,
                 described.model_name, described.max_model_len, described.num_kv_blocks,
                 sender.backend or "none")
        took = time.monotonic()
        print(f"worker {wid} ready (transfer {sender.backend or 'none'}) {started + took - t_load:.1f} s after its "
              f"start: process and imports {started:.1f} s, model and KV cache {t_transfer - t_load:.1f} s, "
              f"KV transfer {took - t_transfer:.1f} s", flush=True)
        group_lost = _watch_group(engine, stop)
        registration = await _register(config, port)
        try:
            await stop.wait()
            # A lost group cannot finish anything: fail what runs at once (UNAVAILABLE: migrated).
            await drain(service, 0.0 if group_lost else config.drain_timeout_s, registration)  # deregisters
            registration = None
        finally:
            if registration is not None:
                await registration.close()
        if group_lost:
            log.error("worker %s: exiting: %s", wid, group_lost[0])
            print(f"worker {wid} failed: {group_lost[0]}", flush=True)
            return 1
        log.info("worker %s: stopping", wid)
        return 0
    finally:
        await health.enter_graceful_shutdown()
        if service.loop is not None:
            # Fail what still runs with UNAVAILABLE while the server can still say so: the
            # frontends migrate those requests.
            await asyncio.to_thread(service.loop.stop)
        service.end_sessions()
        await stop_server(server, config.grace_s)
        if stream is not None:
            await stream.close()
        await service.close()
        if metrics is not None:
            await metrics.close()
        if engine is not None:
            engine.close()
        if tracer is not None:
            tracer.shutdown()             # exports the spans still buffered
        if handle_signals:
            ignore_stop_signals(loop)


def attach_store(config: WorkerServerConfig, engine: Engine, settings: TransferSettings) -> None:
    """Fetch from and publish to the shared block store (before the engine loop starts)."""
    engine.attach_kv_store(KVStoreSettings(config.kv_store, tuple(config.etcd), config.etcd_tls), settings)
    log.info("worker %s: KV store %s", settings.name, config.kv_store)


def _watch_group(engine: Engine, stop: asyncio.Event) -> list[str]:
    """With tensor parallelism: a list that gets why the group was lost, and `stop` set,
    when a rank is gone or a step failed. The worker then exits non-zero so that whoever
    runs the group (the operator, `splitserve serve`) replaces it as a unit."""
    lost: list[str] = []
    if engine.ranks is None:
        return lost
    loop = asyncio.get_running_loop()

    def on_lost(why: str) -> None:
        lost.append(why)
        stop.set()

    def from_any_thread(why: str) -> None:
        try:
            loop.call_soon_threadsafe(on_lost, why)
        except RuntimeError:        # the event loop is closed: the worker is gone already
            pass

    engine.ranks.watch(from_any_thread)
    return lost


def registered_host(config: WorkerServerConfig) -> str:
    """The host others dial: --advertise-host, else --host unless that is a wildcard (a worker
    listening on every interface registered as 0.0.0.0 is reachable by nobody)."""
    host = config.advertise_host or config.host
    if host in WILDCARD_HOSTS:
        raise SplitserveError(f"worker {config.options.worker_id}: --host {config.host} listens on every interface; "
                              "give --advertise-host (the address others reach it at) to register in etcd")
    return host


async def _serve_metrics(config: WorkerServerConfig, service: WorkerService) -> MetricsServer | None:
    """Start the metrics HTTP server (metrics_http.py); None without --metrics-port."""
    if config.metrics_port is None:
        return None
    from splitserve.metrics_http import MetricsApp, MetricsServer
    from splitserve.services.worker.stats_metrics import ServedModel, stats_reader

    def served_model() -> ServedModel | None:
        """What Describe says of the loaded model; None while loading."""
        if service.loop is None:
            return None
        d = service.loop.engine.describe()
        return ServedModel(d.model_name, d.block_size)

    read = stats_reader(lambda: service.read_stats(STATS_TIMEOUT_S), served_model)
    metrics = await MetricsServer.start(MetricsApp(read), config.host, config.metrics_port)
    log.info("worker %s: metrics on http://%s:%d/metrics", config.options.worker_id, config.host, metrics.port)
    print(f"worker {config.options.worker_id} metrics on http://{config.host}:{metrics.port}/metrics", flush=True)
    return metrics


async def _serve_session_stream(config: WorkerServerConfig, service: WorkerService) -> SessionStreamServer | None:
    """Start the session stream (session_stream.py); its port goes out in Describe. None when off."""
    if config.session_port is None:
        return None
    stream = await SessionStreamServer.start(service, config.host, config.session_port,
                                             config.options.tls.server_ssl_context())
    service.session_port = stream.port
    log.info("worker %s: session stream on %s:%d", config.options.worker_id, config.host, stream.port)
    return stream


async def _register(config: WorkerServerConfig, port: int):
    """Register with etcd (a leased key the routers watch); None without --etcd."""
    if not config.etcd:
        return None
    from splitserve.discovery import WorkerRecord
    from splitserve.discovery.etcd import EtcdRegistration

    record = WorkerRecord(config.options.worker_id, config.options.role.value, f"{registered_host(config)}:{port}")
    registration = EtcdRegistration(config.etcd, record, config.etcd_prefix, config.etcd_ttl_s, config.etcd_tls)
    await registration.start()
    return registration
