"""The ingress replica: the existing frontend (HTTP API, router, dispatch) inside Ray Serve.

It builds exactly what `splitserve frontend` builds — tokenizer, worker pool,
the router with its KV-event subscribers and stats poller, the `Frontend`
request lifecycle (routing, prefill peers, migration) and the FastAPI app
from `build_app` — except that the pool's registry is the Ray directory
(directory.py) instead of a static list or etcd. The app is
handed to Serve late (`__serve_build_asgi_app__`), because its routes close
over this replica's `Frontend`. Serve's HTTP proxy forwards each request to
this replica's event loop, where the frontend's gRPC channels live too.

Requests never travel through the worker deployments' Serve handles: the
KV-aware router must choose the exact worker (its cached prefix, its load),
which Serve's own replica choice cannot, so workers are reached over their
gRPC API as everywhere else.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from splitserve.services.ray_serve.directory import DirectoryRegistry
from splitserve.services.ray_serve.settings import IngressSettings

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class PoolView:
    """What this ingress sees: the workers it knows of, and which are ready."""

    known: dict[str, str]          # worker id -> role
    ready: dict[str, str]

    def num_ready(self, role: str) -> int:
        return sum(1 for r in self.ready.values() if r == role)


def build_frontend(settings: IngressSettings, registry):
    """(Frontend, Guard) from services/frontend/server.py's factory, over a pool that follows
    `registry` (the worker directory) once started; no server is started here."""
    from splitserve.services.frontend.server import FrontendConfig, build_frontend as build
    from splitserve.services.frontend.workers.pool import WorkerPool

    r = settings.router
    config = FrontendConfig(model=settings.model, served_model_name=settings.served_model_name, router=r.policy,
                            prefill_router=r.prefill_policy, prefill_weight=r.prefill_weight,
                            router_temperature=r.temperature, remote_prefill_threshold=r.remote_prefill_threshold)
    if settings.migration_limit is not None:
        config.migration_limit = settings.migration_limit
    if settings.migration_wait_s is not None:
        config.migration_wait_s = settings.migration_wait_s
    config.tool_call_parser = settings.tool_call_parser
    config.otlp_traces_endpoint = settings.otlp_traces_endpoint
    return build(config, WorkerPool(tls=config.worker_tls, registry=registry))


class Ingress:
    """The Serve deployment class of the ingress (app.py wraps it with `serve.ingress()`)."""

    async def __init__(self, settings: IngressSettings, directory, *pools) -> None:
        # `pools` are the worker deployments' handles: binding them makes them part of
        # this application's graph; requests go to the workers over gRPC (module docstring).
        self.settings = settings
        self.registry = DirectoryRegistry(directory)
        await self.registry.start()
        self.frontend, self.guard = build_frontend(settings, self.registry)
        self.frontend.pool.start()
        self.frontend.router.start()
        log.info("ingress ready; %d workers in the directory", len(self.registry.members()))

    def __serve_build_asgi_app__(self):
        from splitserve.services.frontend.http.app import build_app

        return build_app(self.frontend, self.guard)

    def pool_view(self) -> PoolView:
        pool = self.frontend.pool
        return PoolView({w.worker_id: w.role for w in pool.workers},
                        {w.worker_id: w.role for w in pool.ready()})

    async def __del__(self) -> None:
        frontend = getattr(self, "frontend", None)
        if frontend is not None:
            await frontend.router.close()
            await frontend.pool.close()
            if frontend.tracer is not None:
                frontend.tracer.shutdown()          # exports the spans still buffered
        registry = getattr(self, "registry", None)
        if registry is not None:
            await registry.close()
