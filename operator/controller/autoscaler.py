"""The operator's SLO autoscaler: `spec.autoscaling` through the planner onto the ServingPools.

For each ServingDeployment with `spec.autoscaling.enabled`, every `intervalSeconds`:

1. read the asked-for group counts from the scale subresources of its ServingPools
   `NAME-prefill` and `NAME-decode` (what the planner calls `replicas`: starting groups
   included; a `kubectl scale` or an HPA that changed them is a change like its own);
2. ask the `MetricsSource` for the interval's `MetricsSample` (metrics_source.py scrapes the
   frontend pods' /metrics and the rank-0 workers' Stats; tests inject a stand-in). None: no
   sample this interval (the first reading only sets a baseline, no frontend answers, ...);
3. `Planner.decide(history, sample)` (services/planner): in the DISAGGREGATED mode, or with
   `switchModes` in AUTO, where "aggregated" is the prefill pool at 0 groups: the decode
   groups then prefill their own prompts, since the router sends a request no prefill
   worker when none is registered (the counts read as `ReplicaCounts.of_aggregated`);
4. apply the counts: a merge patch of `spec.replicas` through each changed ServingPool's
   `scale` subresource, conditional on the count still being the one the decision read (a
   user who scaled in between wins; the planner reads the new count next interval). The
   reconciler then copies the count into the ServingDeployment and creates groups, or drains
   the ones it removes (no request lost), as for `kubectl scale`. A mode switch is two
   patches, the growing pool first: to aggregated, the decode pool grows, then the prefill
   pool drains to 0; back, the prefill pool grows first;
5. record the decision: a log line with `decision.explain()`; the `splitserve_planner_*` metrics
   (planner/decision_metrics.py; `splitserve operator --metrics-port`); an Event `AutoscaleDecision` on
   the ServingDeployment whose message is `explain()` (a decision with the same counts and
   bindings as the previous one bumps that Event's count, as client-go's recorder aggregates);
   `status.autoscaling` (chosen counts, each pool's binding constraint, the predicted and
   observed load, explain()). A patch not applied, or an interval the apiserver refused (say
   Forbidden on servingpools/scale), is a Warning Event `AutoscaleFailed`;
6. refine the deployment's capacity profile with what the interval measured
   (`Planner.learned`); it starts from `spec.autoscaling.profile`.

State (sample history, refined profile) lives in memory per deployment uid: a restarted
operator, or a new leader, starts a fresh history, so it scales down only after a whole
cool-down window of its own samples. It runs only while this replica leads.

Pure pieces (unit-tested): `planner_config`, `capacity_profile`, `scale_patches`,
`autoscaling_status`, `decision_key`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from splitserve.operator import names
from splitserve.operator.builders import POOL_PLURAL, Owner
from splitserve.operator.events import EventRecorder, now_iso
from splitserve.operator.kube import AsyncKube, KubeError, group_path
from splitserve.services.spec.serving_deployment import (API_GROUP, API_VERSION, PLURAL, POOL_NAMES, CapacityProfileSpec,
                                      ServingDeploymentSpec, SloAutoscalingSpec)
from splitserve.services.planner import (CapacityProfile, Decision, MetricsSample, Planner, PlannerConfig,
                                         PlannerMode, PoolBounds, ReplicaCounts, SloTargets, ThroughputCurve)

log = logging.getLogger(__name__)

EVENT_REASON = "AutoscaleDecision"
FAILED_REASON = "AutoscaleFailed"
STATUS_KEY = "autoscaling"            # status.autoscaling: written here only (the reconciler leaves it)
PROFILE_PROMPT_TOKENS = 1024.0        # the x of the profile's one prefill point (the curve is flat from it)
MIN_WINDOW_S = 60.0
SPEC_POLL_S = 5.0                     # the longest wait between two looks at the deployments (spec changes)
APPLY_ATTEMPTS = 3
MESSAGE_LIMIT = 4000


# --- pure pieces ---------------------------------------------------------------------------

def planner_config(spec: SloAutoscalingSpec) -> PlannerConfig:
    """The planner's config for an enabled `spec.autoscaling` (targets required)."""
    if spec.ttft_p90_ms is None or spec.itl_p90_ms is None:
        raise ValueError("spec.autoscaling: ttftP90Ms and itlP90Ms are required when autoscaling is enabled")
    decode = PoolBounds(spec.decode.min_replicas, spec.decode.max_replicas)
    return PlannerConfig(
        SloTargets(spec.ttft_p90_ms / 1e3, spec.itl_p90_ms / 1e3),
        prefill=PoolBounds(spec.prefill.min_replicas, spec.prefill.max_replicas), decode=decode,
        aggregated=decode,                # aggregated groups are the decode pool's
        max_workers=spec.worker_limit, mode=PlannerMode.AUTO if spec.switch_modes else PlannerMode.DISAGGREGATED,
        cooldown_s=float(spec.cooldown_s), window_s=max(MIN_WINDOW_S, 3.0 * spec.interval_s))


def replica_counts(prefill: int, decode: int, switch_modes: bool) -> ReplicaCounts:
    """The planner's counts for the pools' asked-for group counts: with `switch_modes`, no
    prefill group is the aggregated mode (the decode groups prefill their own prompts)."""
    if switch_modes and prefill == 0:
        return ReplicaCounts.of_aggregated(decode)
    return ReplicaCounts.of_pools(prefill, decode)


def pool_counts(replicas: ReplicaCounts) -> dict[str, int]:
    """The ServingPools' group counts for the planner's: aggregated workers are decode groups."""
    if replicas.disaggregated:
        return {"prefill": replicas.num_prefill, "decode": replicas.num_decode}
    return {"prefill": 0, "decode": replicas.num_aggregated}


def capacity_profile(spec: CapacityProfileSpec) -> CapacityProfile:
    """One point per curve: prefill tokens/s (flat at every prompt length) and decode tokens/s
    at `decodeBatchSize` (flat, so a sequence's inter-token time grows linearly with the batch).
    Refining adds the points the workers' counters measure."""
    return CapacityProfile(ThroughputCurve(((PROFILE_PROMPT_TOKENS, spec.prefill_tokens_per_s),)),
                           ThroughputCurve(((float(spec.decode_batch_size), spec.decode_tokens_per_s),)),
                           startup_s=spec.startup_s, kv_capacity_tokens=spec.kv_capacity_tokens)


@dataclass(frozen=True, slots=True)
class ScalePatch:
    """One ServingPool's count to change through its scale subresource."""

    pool: str                 # prefill | decode
    resource: str             # the ServingPool's name
    current: int              # the count the decision read (the patch applies only while it holds)
    replicas: int

    def path(self, namespace: str) -> str:
        return group_path(API_GROUP, API_VERSION, namespace, POOL_PLURAL, self.resource, "scale")

    def body(self, resource_version: str | None = None) -> dict[str, Any]:
        """The merge patch of the Scale; with `resource_version`, refused (409) if it moved on."""
        body: dict[str, Any] = {"spec": {"replicas": self.replicas}}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        return body


def scale_patches(deployment: str, decision: Decision, current: Mapping[str, int]) -> list[ScalePatch]:
    """The patches that take the pools from `current` (their Scale's spec.replicas) to the
    decision's counts (`pool_counts`); pools growing first, so that capacity comes before any goes."""
    wanted = pool_counts(decision.replicas)
    patches = [ScalePatch(pool, names.pool_resource_name(deployment, pool), current[pool], wanted[pool])
               for pool in POOL_NAMES if wanted[pool] != current[pool]]
    return sorted(patches, key=lambda p: p.replicas < p.current)


def decision_key(decision: Decision) -> str:
    """What makes two decisions the same for the Event series: counts, change and bindings."""
    return (f"{decision.current.describe()}->{decision.replicas.describe()}|"
            + ",".join(f"{p.label}:{p.needed}:{p.reachable}" for p in decision.pools))


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, digits)


def autoscaling_status(decision: Decision, now: str, last_scale_time: str | None) -> dict[str, Any]:
    """`status.autoscaling` for one decision."""
    pools = {p.pool: {"current": p.current, "needed": p.needed, "chosen": p.chosen, "binding": p.binding.value,
                      "reachable": p.reachable} for p in decision.pools}
    seen, load = decision.inputs, decision.load
    status: dict[str, Any] = {
        "enabled": True,
        "mode": "disaggregated" if decision.replicas.disaggregated else "aggregated",
        "lastDecisionTime": now,
        "replicas": decision.replicas.describe(),
        "changed": decision.changed,
        "binding": ", ".join(decision.bindings),
        **pools,
        "predicted": {"horizonSeconds": _round(load.horizon_s, 1), "arrivalRate": _round(load.arrival_rate),
                      "prefillTokensPerSecond": _round(load.prefill_tokens_per_s, 1),
                      "decodeTokensPerSecond": _round(load.decode_tokens_per_s, 1)},
        "observed": {"arrivalRate": _round(seen.arrival_rate),
                     "ttftP90Ms": _round(None if seen.ttft_p90_s is None else seen.ttft_p90_s * 1e3, 1),
                     "itlP90Ms": _round(None if seen.itl_p90_s is None else seen.itl_p90_s * 1e3, 1)},
        "message": decision.explain()[:MESSAGE_LIMIT],
    }
    if last_scale_time:
        status["lastScaleTime"] = last_scale_time
    return status


# --- where the samples come from -----------------------------------------------------------

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


# --- the loop ------------------------------------------------------------------------------

@dataclass(slots=True)
class DeploymentState:
    spec: SloAutoscalingSpec
    planner: Planner
    history: deque[MetricsSample]
    next_due: float                       # monotonic
    last_scale_time: str | None = None

    @classmethod
    def of(cls, spec: SloAutoscalingSpec, now: float, profile: CapacityProfile | None = None) -> DeploymentState:
        config = planner_config(spec)
        samples = math.ceil(max(config.cooldown_s, config.window_s) / spec.interval_s) + 4
        return cls(spec, Planner(config, profile or capacity_profile(spec.profile)), deque(maxlen=samples),
                   now + spec.interval_s)

    def respec(self, spec: SloAutoscalingSpec, now: float) -> DeploymentState:
        """After a change of spec.autoscaling: the history stays; the profile too unless it changed."""
        profile = self.planner.profile if spec.profile == self.spec.profile else None
        fresh = DeploymentState.of(spec, now, profile)
        fresh.history.extend(self.history)
        fresh.last_scale_time = self.last_scale_time
        fresh.next_due = min(self.next_due, fresh.next_due)
        return fresh


@dataclass(frozen=True, slots=True)
class PoolScale:
    replicas: int
    resource_version: str | None


_METRICS = None


def decision_metrics():
    """The process's planner metrics (default registry; `splitserve operator --metrics-port` serves them)."""
    global _METRICS
    if _METRICS is None:
        from splitserve.services.planner.decision_metrics import DecisionMetrics

        _METRICS = DecisionMetrics()
    return _METRICS


class Autoscaler:
    """Runs beside the reconcile loop (loop.OperatorLoop starts it) as one asyncio task."""

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
        self.states: dict[str, DeploymentState] = {}
        self.num_decisions = 0

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
        due = min((s.next_due for s in self.states.values()), default=math.inf)
        return max(0.05, min(SPEC_POLL_S, due - self.clock()))

    def _forget_all(self) -> None:
        for uid in list(self.states):
            self._forget(uid)

    def _forget(self, uid: str) -> None:
        self.states.pop(uid, None)
        self.source.forget(uid)
        self.events.forget(uid)

    async def run_due(self) -> None:
        """One look at every deployment: an interval for those that are due."""
        seen = set()
        for body in await self.list_deployments():
            meta = body["metadata"]
            if meta.get("deletionTimestamp"):
                continue
            uid = meta["uid"]
            try:
                spec = ServingDeploymentSpec.from_dict(body.get("spec"))
            except ValueError:
                continue                  # the reconciler reports it (InvalidSpec)
            owner = Owner.from_body(body)
            if not spec.autoscaling.enabled:
                if STATUS_KEY in (body.get("status") or {}):
                    await self._patch_status(owner, None)
                continue
            seen.add(uid)
            try:
                await self._step(owner, spec)
            except KubeError as exc:      # e.g. Forbidden on servingpools/scale: say so on the object
                log.warning("autoscale %s/%s: %s", owner.namespace, owner.name, exc)
                await self.events.record_series(owner, FAILED_REASON, f"autoscaling interval failed: {exc}",
                                                f"kube:{exc.status}", warning=True)
            except Exception:  # one deployment's bad interval must not stop the others
                log.exception("autoscale %s/%s: interval failed", owner.namespace, owner.name)
        for uid in set(self.states) - seen:
            self._forget(uid)

    async def _step(self, owner: Owner, spec: ServingDeploymentSpec) -> None:
        now = self.clock()
        state = self.states.get(owner.uid)
        if state is None:
            # The first interval ends one interval from now; a scraping source takes its baseline now.
            self.states[owner.uid] = DeploymentState.of(spec.autoscaling, now)
            log.info("autoscale %s/%s: on, every %d s (cool-down %d s)", owner.namespace, owner.name,
                     spec.autoscaling.interval_s, spec.autoscaling.cooldown_s)
            await self._sample(owner, spec)
            return
        if state.spec != spec.autoscaling:
            state = self.states[owner.uid] = state.respec(spec.autoscaling, now)
        if now >= state.next_due:
            state.next_due = now + spec.autoscaling.interval_s
            await self.interval(owner, spec, state)

    async def _sample(self, owner: Owner, spec: ServingDeploymentSpec) -> tuple[dict[str, PoolScale],
                                                                                MetricsSample | None]:
        scales = {pool: await self._read_scale(owner, pool) for pool in POOL_NAMES}
        if any(s is None for s in scales.values()):
            return {}, None               # the reconciler has not created the ServingPools yet
        replicas = replica_counts(scales["prefill"].replicas, scales["decode"].replicas,
                                  spec.autoscaling.switch_modes)
        return scales, await self.source.sample(AutoscaleTarget(owner, spec), replicas)

    async def interval(self, owner: Owner, spec: ServingDeploymentSpec, state: DeploymentState) -> Decision | None:
        """One planning interval of one deployment; the decision, or None without a sample."""
        scales, sample = await self._sample(owner, spec)
        if sample is None:
            return None
        if state.history and sample.timestamp <= state.history[-1].timestamp:
            log.warning("autoscale %s/%s: a sample older than the last one, ignored", owner.namespace, owner.name)
            return None
        decision = state.planner.decide(state.history, sample)
        state.planner = state.planner.learned(state.history, sample)
        state.history.append(sample)
        self.num_decisions += 1
        log.info("autoscale %s/%s: %s", owner.namespace, owner.name, decision.explain())
        decision_metrics().record(f"{owner.namespace}/{owner.name}", decision)
        scaled = []
        for patch in scale_patches(owner.name, decision, {p: s.replicas for p, s in scales.items()}):
            outcome = await self.apply(owner, patch)
            if outcome is None:
                scaled.append(patch)
            else:
                await self.events.record(owner, FAILED_REASON, f"{patch.pool} pool not scaled "
                                         f"{patch.current} -> {patch.replicas}: {outcome}", warning=True)
        if scaled:
            state.last_scale_time = now_iso()
            self.on_scaled()
        await self.events.record_series(owner, EVENT_REASON, decision.explain()[:MESSAGE_LIMIT],
                                        decision_key(decision))
        await self._patch_status(owner, autoscaling_status(decision, now_iso(), state.last_scale_time))
        return decision

    async def _read_scale(self, owner: Owner, pool: str) -> PoolScale | None:
        path = group_path(API_GROUP, API_VERSION, owner.namespace, POOL_PLURAL,
                          names.pool_resource_name(owner.name, pool), "scale")
        scale = await self.kube.get(path)
        if scale is None:
            return None
        return PoolScale(int((scale.get("spec") or {}).get("replicas") or 0),
                         scale["metadata"].get("resourceVersion"))

    async def apply(self, owner: Owner, patch: ScalePatch) -> str | None:
        """Patch one ServingPool's Scale while its count is still `patch.current`; None when
        applied, else why not (someone else scaled it, or the apiserver refused)."""
        for _ in range(APPLY_ATTEMPTS):
            scale = await self._read_scale(owner, patch.pool)
            if scale is None:
                return f"ServingPool {patch.resource} is gone"
            if scale.replicas != patch.current:
                return f"ServingPool {patch.resource} was scaled to {scale.replicas} meanwhile"
            try:
                await self.kube.merge_patch(patch.path(owner.namespace), patch.body(scale.resource_version))
                return None
            except KubeError as exc:
                if not exc.conflict:
                    return str(exc)
        return f"ServingPool {patch.resource} kept changing ({APPLY_ATTEMPTS} conflicts)"

    async def _patch_status(self, owner: Owner, status: dict[str, Any] | None) -> None:
        path = group_path(API_GROUP, API_VERSION, owner.namespace, PLURAL, owner.name, "status")
        try:
            await self.kube.merge_patch(path, {"status": {STATUS_KEY: status}})
        except KubeError as exc:
            if not exc.not_found:
                raise
