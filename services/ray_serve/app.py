"""The application builder: a `RayServeConfig` becomes one Ray Serve application.

The graph is ingress -> (directory, prefill pool, decode pool); workers ->
directory. Each pool is one deployment of `WorkerReplica` (worker.py) whose
replicas are worker groups:

- replicas: `num_replicas`, or Ray Serve's `autoscaling_config` when the pool
  has `autoscaling` (its target is ongoing requests per replica);
- resources: the replica actor asks for one rank's CPUs and GPUs; a group of
  TP ranks gets a placement group with one bundle per rank, STRICT_PACK unless
  the spec's topology is `none`, so the whole group lands on one node or not at
  all (Serve creates one placement group per replica);
- versions: each deployment's version is a hash of what its replicas are
  built with (class, constructor arguments, resources), never of the replica
  count, so redeploying a config that only changes counts scales the pool in
  place instead of restarting every worker. `Deployment.options(version=...)`
  is internal in Ray 2.60 (`_internal=True`); without it Serve restarts them.

`deployment_options()` is a pure function (unit-tested without Ray).
"""

from __future__ import annotations

import hashlib
import logging
import pickle
from typing import Any

from splitserve.services.ray_serve.settings import PoolPlan, RayServeConfig

log = logging.getLogger(__name__)

DIRECTORY_NAME = "WorkerDirectory"
INGRESS_NAME = "Frontend"
# Streams last as their generation; the frontend has its own timeouts.
MAX_ONGOING_REQUESTS = 1000
# No Serve access log line per call: leases renew every second, and the frontend logs its requests.
LOGGING = {"enable_access_log": False}
STOP_GRACE_S = 15.0     # lease release and server stop after the drain


def _version(*parts: Any) -> str:
    return hashlib.sha256(pickle.dumps(parts)).hexdigest()[:16]


def deployment_options(pool: PoolPlan) -> dict:
    """Ray Serve deployment options for one pool (pure)."""
    rank: dict[str, float] = {"CPU": pool.cpus_per_rank}
    if pool.gpus_per_rank:
        rank["GPU"] = pool.gpus_per_rank
    actor: dict[str, Any] = {"num_cpus": pool.cpus_per_rank, "num_gpus": pool.gpus_per_rank}
    if pool.memory_bytes_per_rank:
        rank["memory"] = pool.memory_bytes_per_rank
        actor["memory"] = pool.memory_bytes_per_rank
    options: dict[str, Any] = {"name": pool.name, "ray_actor_options": actor,
                               "max_ongoing_requests": MAX_ONGOING_REQUESTS,
                               "health_check_period_s": 2.0, "logging_config": dict(LOGGING),
                               # Serve kills a stopping replica after this: leave room for the drain.
                               "graceful_shutdown_timeout_s": pool.worker.drain_timeout_s + STOP_GRACE_S}
    if pool.worker.tensor_parallel > 1:
        options["placement_group_bundles"] = [dict(rank) for _ in range(pool.worker.tensor_parallel)]
        options["placement_group_strategy"] = pool.placement_strategy
    if pool.autoscaling is not None:
        options["autoscaling_config"] = pool.autoscaling.to_ray()
    else:
        options["num_replicas"] = pool.replicas
    options["version"] = _version("worker", pool.worker, actor, options.get("placement_group_bundles"))
    return options


def _with_options(deployment, options: dict):
    version = options.pop("version", None)
    deployment = deployment.options(**options)
    if version is not None:
        try:
            deployment = deployment.options(version=version, _internal=True)
        except (TypeError, ValueError) as exc:   # a Ray without the internal knob: scaling restarts replicas
            log.warning("ray serve: no stable deployment version (%s); scaling restarts workers", exc)
    return deployment


def build_application(config: RayServeConfig):
    """The Serve application (`serve.run(build_application(config), name=config.app_name)`)."""
    from ray import serve

    from splitserve.services.ray_serve.directory import WorkerDirectory
    from splitserve.services.ray_serve.ingress import Ingress
    from splitserve.services.ray_serve.worker import WorkerReplica

    # A stable version for the directory and the ingress too: restarting either on a
    # scale-only redeploy would empty the routers' worker lists for a moment.
    directory = serve.deployment(WorkerDirectory).options(
        name=DIRECTORY_NAME, num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=MAX_ONGOING_REQUESTS, logging_config=dict(LOGGING))
    directory = _with_options(directory, {"version": _version("directory")}).bind()
    pools = []
    for pool in config.pools:
        deployment = _with_options(serve.deployment(WorkerReplica), deployment_options(pool))
        pools.append(deployment.bind(pool.worker, directory))
    ingress = serve.deployment(serve.ingress()(Ingress)).options(
        name=INGRESS_NAME, num_replicas=config.ingress_replicas, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=MAX_ONGOING_REQUESTS, logging_config=dict(LOGGING))
    ingress = _with_options(ingress, {"version": _version("ingress", config.ingress)})
    return ingress.bind(config.ingress, directory, *pools)
