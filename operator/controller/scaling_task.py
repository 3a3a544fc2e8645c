"""The operator's SLO autoscaler: `spec.autoscaling` of every ServingDeployment, one task beside the
reconcile loop (loop.OperatorLoop starts it).

For each ServingDeployment with `spec.autoscaling.enabled` it runs the shared loop
(services/autoscaling `ScalingLoop`, every `intervalSeconds`) with the operator's seams:

- samples from the `MetricsSource` (metrics_source.py scrapes the frontend pods' /metrics and
  the rank-0 workers' Stats; tests inject a stand-in), for the deployment (`AutoscaleTarget`);
- the counts asked for and their changes through the ServingPools' scale subresources, and
  the decision's Event and status.autoscaling (pool_scaling.PoolScaling);
- the decision's log line through this package's logger, `autoscale NAMESPACE/NAME: ...`, and
  the `splitserve_planner_*` metrics (planner/decision_metrics.py; `splitserve operator
  --metrics-port`) labelled NAMESPACE/NAME;
- the planner's config and start profile from `spec.autoscaling` (pool_scaling.planner_config,
  capacity_profile); a change of spec.autoscaling keeps the sample history, and the refined
  profile unless `profile` changed.

It looks at the deployments at the latest every SPEC_POLL_S (spec changes) and when an
interval is due. A deployment deleted, or whose autoscaling is turned off (its
status.autoscaling is then removed), is forgotten. State (sample history, refined profile)
lives in memory per deployment uid: a restarted operator, or a new leader, starts a fresh
history, so it scales down only after a whole cool-down window of its own samples. It runs
only while this replica leads.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from splitserve.operator.builders import Owner
from splitserve.operator.events import EventRecorder
from splitserve.operator.kube import AsyncKube, KubeError
from splitserve.operator.pool_scaling import (STATUS_KEY, PoolScaling, capacity_profile, patch_status,
                                              planner_config)
from splitserve.services.spec.serving_deployment import ServingDeploymentSpec
from splitserve.services.autoscaling import DecisionLog, ScalingLoop
from splitserve.services.planner import MetricsSample, Planner, ReplicaCounts

log = logging.getLogger(__name__)

SPEC_POLL_S = 5.0                     # the longest wait between two looks at the deployments (spec changes)


@dataclass(frozen=True, slots=True)
class AutoscaleTarget:
    owner: Owner
    spec: ServingDeploymentSpec


class MetricsSource(Protocol):
    """One planner sample per call for a deployment (the interval since its previous call)."""

    async def sample(self, target: AutoscaleTarget, replicas: ReplicaCounts) -> MetricsSample | None:
        """The interval's sample, `replicas` being the asked-for counts; None: none this time."""

    def forget(self, uid: str) -> None:
        """Drop what is kept for a deployment (deleted, or autoscaling turned off)."""


_METRICS = None


def decision_metrics():
    """The process's planner metrics (default registry; `splitserve operator --metrics-port` serves them)."""
    global _METRICS
    if _METRICS is None:
        from splitserve.services.planner.decision_metrics import DecisionMetrics

        _METRICS = DecisionMetrics()
    return _METRICS


class DeploymentScaling:
    """One ServingDeployment's autoscaling: its spec, its pools and its loop. It is the loop's
    `SampleSource` for the deployment: the operator's `MetricsSource` asked with its target."""

    def __init__(self, source: MetricsSource, pools: PoolScaling, spec: ServingDeploymentSpec,
                 clock: Callable[[], float]):
        auto = spec.autoscaling
        owner = pools.owner
        self.source = source
        self.pools = pools
        self.spec = spec
        where = f"{owner.namespace}/{owner.name}"
        self.loop = ScalingLoop(Planner(planner_config(auto), capacity_profile(auto.profile)), float(auto.interval_s),
                                self, pools, pools, DecisionLog(_log_info, f"autoscale {where}: ", where,
                                                                decision_metrics()), clock)

    async def sample(self, replicas: ReplicaCounts) -> MetricsSample | None:
        return await self.source.sample(AutoscaleTarget(self.pools.owner, self.spec), replicas)

    def follow(self, spec: ServingDeploymentSpec) -> None:
        """The deployment's current spec; after a change of spec.autoscaling, the loop's new config
        (the history stays; the profile too unless `profile` changed)."""
        before, auto = self.spec.autoscaling, spec.autoscaling
        self.spec = spec
        if auto == before:
            return
        profile = self.loop.planner.profile if auto.profile == before.profile else capacity_profile(auto.profile)
        self.pools.switch_modes = auto.switch_modes
        self.loop.reconfigure(Planner(planner_config(auto), profile), float(auto.interval_s))


def _log_info(line: str) -> None:
    log.info("%s", line)


class Autoscaler:
    """Runs one `ScalingLoop` per autoscaled ServingDeployment, as one asyncio task (module header)."""

    def __init__(self, kube: AsyncKube, events: EventRecorder, source: MetricsSource,
                 list_deployments: Callable[[], Awaitable[list[dict[str, Any]]]],
                 leading: Callable[[], bool] = lambda: True, on_scaled: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic):
        self.kube = kube
        self.events = events
        self.source = source
        self.list_deployments = list_deployments
        self.leading = leading
        self.on_scaled = on_scaled            # wakes the reconcile loop after a scale patch
        self.clock = clock
        self.states: dict[str, DeploymentScaling] = {}

    @property
    def num_decisions(self) -> int:
        """The decisions made for the deployments it scales now."""
        return sum(s.loop.num_decisions for s in self.states.values())

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            try:
                if self.leading():
                    await self.run_due()
                else:
                    self._forget_all()
            except (KubeError, OSError) as exc:
                log.warning("autoscaler pass failed, retrying: %s", exc)
            except Exception:  # never end the operator over one bad pass
                log.exception("autoscaler pass failed, retrying")
            try:
                await asyncio.wait_for(stopping.wait(), self._sleep_s())
            except TimeoutError:
                pass

    def _sleep_s(self) -> float:
        due = min((s.loop.seconds_to_due() for s in self.states.values()), default=math.inf)
        return max(0.05, min(SPEC_POLL_S, due))

    def _forget_all(self) -> None:
        for uid in list(self.states):
            self._forget(uid)

    def _forget(self, uid: str) -> None:
        self.states.pop(uid, None)
        self.source.forget(uid)
        self.events.forget(uid)

    async def run_due(self) -> None:
        """One look at every deployment: the baseline of a new one, an interval for those due."""
        seen = set()
        for body in await self.list_deployments():
            meta = body["metadata"]
            if meta.get("deletionTimestamp"):
                continue
            try:
                spec = ServingDeploymentSpec.from_dict(body.get("spec"))
            except ValueError:
                continue                  # the reconciler reports it (InvalidSpec)
            owner = Owner.from_body(body)
            if not spec.autoscaling.enabled:
                if STATUS_KEY in (body.get("status") or {}):
                    await patch_status(self.kube, owner, None)
                continue
            seen.add(owner.uid)
            try:
                await self.scaling(owner, spec).loop.step()
            except Exception:  # one deployment's bad interval must not stop the others
                log.exception("autoscale %s/%s: interval failed", owner.namespace, owner.name)
        for uid in set(self.states) - seen:
            self._forget(uid)

    def scaling(self, owner: Owner, spec: ServingDeploymentSpec) -> DeploymentScaling:
        """The deployment's autoscaling, following `spec`; a new one's loop reads its baseline first."""
        state = self.states.get(owner.uid)
        if state is None:
            pools = PoolScaling(self.kube, self.events, owner, spec.autoscaling.switch_modes, self.on_scaled)
            state = self.states[owner.uid] = DeploymentScaling(self.source, pools, spec, self.clock)
            log.info("autoscale %s/%s: on, every %d s (cool-down %d s)", owner.namespace, owner.name,
                     spec.autoscaling.interval_s, spec.autoscaling.cooldown_s)
        else:
            state.follow(spec)
        return state
