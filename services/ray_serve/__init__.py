"""splitserve as a Ray Serve application, built from the same components.

The ingress replica runs the existing frontend (HTTP API, KV-aware router,
dispatch and migration); prefill and decode replicas run the existing worker
(engine, gRPC service, KV events, kvtransfer); a small directory deployment
gives the router its worker list (leases, like etcd). One ServingDeployment
file describes both this and the Kubernetes target.

    splitserve serve --on-ray [--ray-address ADDR] [--config deployment.yaml]
    serve run splitserve.services.ray_serve:app_builder config=deployment.yaml

From Python: `build_application(config_from_spec(read_spec(path)))`.
Modules: settings (typed config), config (spec/flags -> config), app
(deployment options, the graph), worker, ingress, directory, launch.
"""

from __future__ import annotations

from splitserve.services.ray_serve.app import build_application, deployment_options
from splitserve.services.ray_serve.config import config_from_spec, read_spec
from splitserve.services.ray_serve.settings import EngineSettings, RayServeConfig

__all__ = ["app_builder", "build_application", "config_from_spec", "deployment_options", "read_spec",
           "EngineSettings", "RayServeConfig"]


def app_builder(args: dict):
    """For `serve run splitserve.services.ray_serve:app_builder config=FILE [kv_cache_gib=G]
    [threads=N] [transfer=auto|nixl|tcp]`: the application described by FILE."""
    if "config" not in args:
        raise ValueError("give config=PATH (a ServingDeployment manifest or its spec)")
    spec = read_spec(args["config"])
    engine = EngineSettings(model=spec.model.source, kv_cache_gib=float(args.get("kv_cache_gib", 1.0)),
                            threads=int(args["threads"]) if "threads" in args else None)
    return build_application(config_from_spec(spec, engine, args.get("transfer", "auto")))
