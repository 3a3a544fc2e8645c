"""Ray Serve autoscaling for the worker pools, on the workers' own in-flight counts.

Serve's default policy scales on the requests that pass through its handles,
but a worker's requests reach it over gRPC from the router, so Serve would see
every worker idle. Each worker replica therefore reports its worker's
`num_in_flight` (Generate and Prefill calls being served, from the worker's
Stats) through `record_autoscaling_stats`, and this policy sizes the pool so
that each replica carries about `target_ongoing_requests` of them:

    desired = total in-flight over the pool / target_ongoing_requests

Serve then applies the usual bounds and delays of the pool's
autoscaling_config (min/max replicas, upscale/downscale delay) to `desired`.
The import path of `in_flight_policy` is what app.py puts in the config; the
Serve controller imports it, so splitserve must be installed on its node.
"""

from __future__ import annotations

from typing import Any

IN_FLIGHT_METRIC = "splitserve_in_flight"
POLICY_PATH = "splitserve.services.ray_serve.autoscaling:in_flight_policy"


def desired_replicas(in_flight: dict[Any, float], target: float, current: int) -> float:
    """The pool size for these per-replica in-flight averages (pure)."""
    if not in_flight:
        return float(current)            # no report yet: hold
    return sum(in_flight.values()) / target


def in_flight_policy(ctx) -> tuple[float, dict]:
    """A Ray Serve custom autoscaling policy (`AutoscalingContext` -> (replicas, state))."""
    metrics = ctx.aggregated_metrics or {}
    target = ctx.config.get_target_ongoing_requests()
    return desired_replicas(metrics.get(IN_FLIGHT_METRIC, {}), target, ctx.current_num_replicas), {}
