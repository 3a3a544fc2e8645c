"""`splitserve epp`: the ext_proc server a Gateway calls to pick each request's model server.

One asyncio process: the ext_proc gRPC service (`ExternalProcessor.Process`, one `Exchange` per
request) with the standard gRPC health on the same port, a second gRPC port for the liveness and
readiness probes, and `/metrics` (the router's families and the picker's own). The workers come
from the InferencePool's pods (`--pool-name`), from etcd (`--etcd`, as the frontend finds them) or
from `--worker` flags; the router is the frontend's, fed by the workers' KV events and Stats. The
picker is ready once it has listed its pool; SIGTERM/SIGINT turns readiness off, lets open streams
finish for `--drain-timeout` seconds, then stops. With `--flow-control` each request is admitted
by the frontend's flow control (services/frontend/flow_admission.py) between its parse and its
pick, and holds its unit until its response ends.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2_grpc

from splitserve.errors import SplitserveError
from splitserve.grpc_server_stop import stop_server
from splitserve.metrics_http import MetricsApp, MetricsServer
from splitserve.stop_signals import handle_stop_signals, ignore_stop_signals
from splitserve.tls import PLAINTEXT, TlsConfig

from splitserve.services.flow_control import Ticket
from splitserve.services.frontend.flow_headers import flow_request
from splitserve.services.frontend.server import FrontendConfig, build_frontend
from splitserve.services.frontend.workers.pool import WorkerAddress, WorkerPool

from splitserve.services.epp.endpoints import EndpointBook
from splitserve.services.epp.exchange import Admission, Exchange
from splitserve.services.epp.health import ExtProcHealth, ProbeHealth
from splitserve.services.epp.metrics import EppMetrics
from splitserve.services.epp.objectives import ObjectiveBook, ObjectiveWatch
from splitserve.services.epp.picker import EndpointPicker
from splitserve.services.epp.protocol import add_ext_proc_handler

log = logging.getLogger(__name__)
READY_POLL_S = 0.25
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass(slots=True)
class EppConfig:
    frontend: FrontendConfig                 # model, router, etcd, worker TLS: as a frontend's
    port: int = 9002                          # ext_proc (+ grpc.health.v1)
    health_port: int = 9003                   # liveness / readiness
    metrics_port: int | None = 9090
    pool_name: str | None = None              # learn the workers from this InferencePool's pods
    pool_namespace: str = "default"
    target_port: int = 8000                   # a worker's gateway port (the pool's targetPorts win)
    endpoints: list[str] = field(default_factory=list)    # GRPC=HTTP overrides (several workers per host)
    fallbacks: int = 0                        # endpoints after the primary (a proxy that retries them)
    objectives: list[tuple[str, int]] = field(default_factory=list)   # --objective NAME=PRIORITY
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    tls: TlsConfig = PLAINTEXT                # the ext_proc port's (the gateway's client TLS)
    drain_timeout_s: float = 10.0


class ExternalProcessor:
    """Envoy's `ExternalProcessor.Process`: one `Exchange` per stream (one request)."""

    def __init__(self, picker: EndpointPicker, metrics: EppMetrics, max_body_bytes: int,
                 admission: Admission | None = None):
        self.picker = picker
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.admission = admission

    async def process(self, request_iterator, context):
        exchange = Exchange(self.picker, self.metrics, self.max_body_bytes, self.admission)
        self.metrics.streams.inc()
        try:
            async for message in request_iterator:
                for response in await exchange.on(message):
                    yield response
                if exchange.ended:
                    return
        finally:
            exchange.close()
            self.metrics.streams.dec()


def _admission(frontend, objectives: ObjectiveBook, metrics: EppMetrics) -> Admission | None:
    """Flow control before the pick (FrontendConfig.flow_control, as a frontend's --flow-control):
    the same bands, flows (x-llm-d-inference-fairness-id) and TTFT deadlines, and the priority of
    the request's InferenceObjective where its header names a known one (objectives.py); room is
    --max-concurrency requests per ready decode worker, each held until its response ends."""
    flow_control = frontend.flow_control
    if flow_control is None:
        return None

    async def admit(headers: dict[str, str], priority: int) -> Ticket:
        name = objectives.named(headers)
        if name:
            resolved = objectives.priority_of(name)
            metrics.objective(resolved is not None)
            if resolved is not None:
                priority = resolved
        return await flow_control.admit(flow_request(headers.items(), priority, None, ""))

    return admit


async def run_epp(config: EppConfig) -> int:
    endpoints = EndpointBook.parse(config.target_port, config.endpoints)
    registry = None
    if config.pool_name:
        from splitserve.services.epp.pool_pods import PoolPods

        registry = PoolPods(config.pool_namespace, config.pool_name, endpoints)
    elif config.frontend.etcd:
        from splitserve.discovery.etcd import EtcdRegistry

        registry = EtcdRegistry(config.frontend.etcd, config.frontend.etcd_prefix, tls=config.frontend.etcd_tls)
    if registry is not None:
        await registry.start()
    pool = WorkerPool.connect([WorkerAddress.parse(w) for w in config.frontend.workers], config.frontend.worker_tls,
                              registry)
    frontend, _ = build_frontend(config.frontend, pool)
    picker = EndpointPicker(frontend, frontend.router, endpoints, config.fallbacks,
                            config.frontend.limits.max_prompt_tokens)
    metrics = EppMetrics(frontend.metrics.registry)

    objectives = ObjectiveBook(dict(config.objectives))
    objective_watch = None
    if config.pool_name:
        objective_watch = ObjectiveWatch(objectives, config.pool_namespace, config.pool_name)
        await objective_watch.start()
    admission = _admission(frontend, objectives, metrics)
    if frontend.flow_control is not None:
        print(f"epp: {frontend.flow_control.settings.describe()}", flush=True)
    ext_health = ExtProcHealth()
    draining = False

    def ready() -> bool:
        return not draining and (getattr(registry, "synced", True) if registry is not None else True)

    server = grpc.aio.server()
    add_ext_proc_handler(server, ExternalProcessor(picker, metrics, config.max_body_bytes, admission).process)
    health_pb2_grpc.add_HealthServicer_to_server(ext_health.servicer, server)
    host = config.frontend.host
    if config.tls.add_port(server, f"{host}:{config.port}") == 0:
        raise SplitserveError(f"cannot listen for ext_proc on {host}:{config.port}")
    probes = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(ProbeHealth(ready), probes)
    if probes.add_insecure_port(f"{host}:{config.health_port}") == 0:
        raise SplitserveError(f"cannot listen for health probes on {host}:{config.health_port}")
    metrics_server = None
    if config.metrics_port is not None:
        metrics_server = await MetricsServer.start(MetricsApp(registry=frontend.metrics.registry), host,
                                                   config.metrics_port)
    await ext_health.set_ready(False)
    await server.start()
    await probes.start()
    pool.start()
    frontend.router.start()
    print(f"epp: ext_proc listening on {host}:{config.port} (health probes on {config.health_port}"
          + (f", metrics on {metrics_server.port}" if metrics_server else "") + ")", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handle_stop_signals(loop, stop)
    try:
        while not stop.is_set():
            await ext_health.set_ready(ready())
            try:
                await asyncio.wait_for(stop.wait(), READY_POLL_S)
            except TimeoutError:
                pass
        draining = True
        await ext_health.set_ready(False)
        await server.stop(config.drain_timeout_s)
    finally:
        await server.stop(0)
        await stop_server(probes, 0)
        await frontend.router.close()
        if metrics_server is not None:
            await metrics_server.close()
        if registry is not None:
            await registry.close()
        if objective_watch is not None:
            await objective_watch.close()
        await pool.close()
        ignore_stop_signals(loop)
    return 0
