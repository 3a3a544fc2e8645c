"""`splitserve frontend`: the HTTP API (uvicorn) and the public gRPC API in one event loop.

The tokenizer comes from the model folder (no weights are loaded here), and so do
the defaults of omitted sampling parameters (its generation_config.json, as vLLM
does; sampling_defaults.py, --generation-config); the model's name and context
length come from the workers' Describe once they report SERVING. /ready and
/v1/models answer 200 once at least one decode-capable worker is ready (503
before). SIGTERM or SIGINT drains first (/ready fails, new requests get 503,
running ones get up to --drain-timeout to finish), then stops both servers and
closes the worker channels.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
import uvicorn

from splitserve.errors import SplitserveError
from splitserve.grpc_server_stop import stop_server
from splitserve.proto.v1 import inference_pb2_grpc
from splitserve.router.policies.kv import DEFAULT_PREFILL_WEIGHT
from splitserve.checkpoints.model_source import open_checkpoint
from splitserve.services.text.tokenizer import Tokenizer
from splitserve.stop_signals import handle_stop_signals, ignore_stop_signals
from splitserve.tls import PLAINTEXT, TlsConfig
from splitserve.tracing import start_tracer

from splitserve.services.frontend.live_moves import MoveOffDrainingWorkers
from splitserve.services.frontend.auth import ApiKeys
from splitserve.services.frontend.grpc.inference import InferenceService
from splitserve.services.frontend.grpc.guard import GuardInterceptor
from splitserve.services.frontend.guard import Guard
from splitserve.services.frontend.core import Frontend
from splitserve.services.frontend.flow_admission import FlowControlSettings, FrontendFlowControl
from splitserve.services.frontend.migration import DEFAULT_LIMIT as DEFAULT_MIGRATION_LIMIT, MigrationPolicy
from splitserve.services.frontend.migration import DEFAULT_WAIT_S as DEFAULT_MIGRATION_WAIT_S
from splitserve.services.frontend.fault_metrics import WorkerRestarts
from splitserve.services.frontend.metrics import FrontendMetrics
from splitserve.services.frontend.http.app import build_app
from splitserve.services.frontend.limits import LimitsConfig
from splitserve.services.frontend.routing import build_router
from splitserve.services.frontend.sampling_defaults import MODE_AUTO, load_sampling_defaults
from splitserve.services.frontend.workers.pool import WorkerAddress, WorkerPool

log = logging.getLogger(__name__)


@dataclass(slots=True)
class FrontendConfig:
    model: str
    workers: list[str] = field(default_factory=list)    # ROLE=HOST:PORT
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int | None = None
    served_model_name: str | None = None
    router: str = "kv"                      # kv | round-robin | random | least-loaded | power-of-two
    prefill_router: str | None = None       # the prefill leg's policy (default: the same)
    router_seed: int | None = None
    prefill_weight: float = DEFAULT_PREFILL_WEIGHT
    router_temperature: float = 0.0
    kv_tier_credit: dict[str, float] = field(default_factory=dict)   # host/disk tier → share of a device hit
    remote_prefill_threshold: int = 64
    etcd: list[str] = field(default_factory=list)    # HOST:PORT endpoints: discover workers there
    etcd_prefix: str = "/splitserve/workers/"
    etcd_tls: TlsConfig = PLAINTEXT                  # client TLS to etcd (CA, client certificate)
    migration_limit: int = DEFAULT_MIGRATION_LIMIT   # re-dispatches of a request whose worker failed
    migration_wait_s: float = DEFAULT_MIGRATION_WAIT_S   # ...waiting this long for a decode worker
    drain_timeout_s: float = 30.0           # on SIGTERM: running requests get this long to finish
    tls: TlsConfig = PLAINTEXT              # HTTPS and the public gRPC port (--tls-cert/--tls-key)
    worker_tls: TlsConfig = PLAINTEXT       # mutual TLS to the workers (--tls-ca, --tls-client-cert/-key)
    api_keys: ApiKeys = field(default_factory=ApiKeys)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    # Defaults of omitted sampling parameters: auto (the model's generation_config.json),
    # vllm (the engine's neutral ones) or a folder holding a generation_config.json.
    generation_config: str = MODE_AUTO
    tool_call_parser: str | None = None     # tool_choice="auto" reads calls with it (None: refused)
    otlp_traces_endpoint: str | None = None  # export traces there (splitserve/tracing.py); None: off
    flow_control: FlowControlSettings | None = None   # --flow-control (flow_admission.py); None: off
    gateway: bool = False     # an endpoint picker routes; its prefill pick arrives in a header (gateway.py)


def build_frontend(config: FrontendConfig, pool: WorkerPool) -> tuple[Frontend, Guard]:
    """The request path (tokenizer, router, migration, limits) over `pool`; starts nothing.

    The pool keeps its own members (a static list, or its registry: etcd, or Ray's worker
    directory). `run_frontend` and the Ray Serve ingress both build their frontend here.
    """
    checkpoint = open_checkpoint(config.model)
    tokenizer = Tokenizer(checkpoint)
    defaults = load_sampling_defaults(config.generation_config, checkpoint.generation_config, checkpoint.source)
    print(f"frontend: {defaults.startup_line()}", flush=True)
    metrics = FrontendMetrics()
    try:
        router = build_router(pool, config.router, config.prefill_router, config.router_seed,
                              config.prefill_weight, config.router_temperature, config.remote_prefill_threshold,
                              metrics_registry=metrics.registry, tier_credit=config.kv_tier_credit)
    except ValueError as exc:
        raise SplitserveError(str(exc)) from None
    tracer = start_tracer("splitserve-frontend", config.otlp_traces_endpoint)
    if tracer is not None:
        print(f"frontend: exporting traces to {config.otlp_traces_endpoint} (OTLP/gRPC)", flush=True)
    frontend = Frontend(tokenizer, pool, router, metrics, config.served_model_name,
                        MigrationPolicy(config.migration_limit, config.migration_wait_s), defaults, tracer)
    frontend.tool_parser = config.tool_call_parser
    if config.flow_control is not None:
        frontend.flow_control = FrontendFlowControl(config.flow_control, pool, metrics.registry)
        print(f"frontend: {config.flow_control.describe()}", flush=True)
    frontend.gateway = config.gateway
    pool.subscribe(MoveOffDrainingWorkers(frontend.move_all_off))   # a draining decode worker's requests move
    router.feeds.stats_listeners.append(metrics.faults.workers.update)
    metrics.registry.register(WorkerRestarts(lambda: pool.workers))
    return frontend, Guard(config.api_keys, config.limits, metrics.rejected)


async def run_frontend(config: FrontendConfig) -> int:
    addresses = [WorkerAddress.parse(w) for w in config.workers]
    if not config.etcd and not any(a.role in ("both", "decode") for a in addresses):
        raise SplitserveError("the frontend needs at least one worker with role both or decode (or --etcd)")
    registry = None
    if config.etcd:
        from splitserve.discovery.etcd import EtcdRegistry

        registry = EtcdRegistry(config.etcd, config.etcd_prefix, tls=config.etcd_tls)
        await registry.start()
    pool = WorkerPool.connect(addresses, config.worker_tls, registry)
    frontend, guard = build_frontend(config, pool)
    router = frontend.router
    app = build_app(frontend, guard)
    uv = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                       access_log=False, lifespan="off", timeout_graceful_shutdown=5,
                                       **config.tls.uvicorn_kwargs()))
    uv.install_signal_handlers = lambda: None    # we own SIGTERM/SIGINT below
    grpc_server = None
    if config.grpc_port is not None:
        grpc_server = grpc.aio.server(interceptors=[GuardInterceptor(guard)])
        inference_pb2_grpc.add_InferenceServicer_to_server(
            InferenceService(frontend, config.limits.max_prompt_tokens, guard.keys), grpc_server)
        bound = config.tls.add_port(grpc_server, f"{config.host}:{config.grpc_port}")
        if bound == 0:
            raise SplitserveError(f"cannot listen for gRPC on {config.host}:{config.grpc_port}")
        await grpc_server.start()
        print(f"frontend gRPC listening on {config.host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handle_stop_signals(loop, stop)
    pool.start()
    router.start()
    serving = asyncio.create_task(uv.serve(), name="uvicorn")
    stopper = asyncio.create_task(stop.wait(), name="stop")
    try:
        await asyncio.wait({serving, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if serving.done() and serving.exception() is None and not uv.started:
            raise SplitserveError(f"cannot listen for HTTP on {config.host}:{config.port}")
        if stopper.done():
            # Graceful: stop admission, let running requests finish, then close.
            began = time.monotonic()
            left = await frontend.drain(config.drain_timeout_s)
            log.info("frontend: drained in %.2f s (%d requests still running)", time.monotonic() - began, left)
    finally:
        uv.should_exit = True
        stopper.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        if grpc_server is not None:
            await stop_server(grpc_server, 2)
        await router.close()
        if registry is not None:
            await registry.close()
        await pool.close()
        if frontend.tracer is not None:
            frontend.tracer.shutdown()          # exports the spans still buffered
        ignore_stop_signals(loop)
    return 0
