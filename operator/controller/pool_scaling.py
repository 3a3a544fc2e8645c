"""The operator's side of SLO autoscaling for one ServingDeployment: its ServingPools' scale
subresources as the loop's `ScaleActuator`, and its Event and status.autoscaling as the
`DecisionReporter` (services/autoscaling runs the loop; scaling_task.py runs one per deployment).

- `read_replicas`: the asked-for group counts from the scale subresources of the ServingPools
  `NAME-prefill` and `NAME-decode` (what the planner calls `replicas`: starting groups
  included; a `kubectl scale` or an HPA that changed them is a change like its own). With
  `switchModes`, "aggregated" is the prefill pool at 0 groups: the decode groups then prefill
  their own prompts, since the router sends a request no prefill worker when none is
  registered (the counts read as `ReplicaCounts.of_aggregated`). None while the reconciler has
  not created the ServingPools.
- `apply`: a merge patch of `spec.replicas` through each changed ServingPool's `scale`
  subresource, conditional on the count still being the one the decision read (a user who
  scaled in between wins; the planner reads the new count next interval). The reconciler then
  copies the count into the ServingDeployment and creates groups, or drains the ones it
  removes (no request lost), as for `kubectl scale`. A mode switch is two patches, the growing
  pool first: to aggregated, the decode pool grows, then the prefill pool drains to 0; back,
  the prefill pool grows first. A patch not applied is a Warning Event `AutoscaleFailed`; one
  applied wakes the reconcile loop.
- `report`: an Event `AutoscaleDecision` on the ServingDeployment whose message is `explain()`
  (a decision with the same counts and bindings as the previous one bumps that Event's count,
  as client-go's recorder aggregates) and `status.autoscaling` (chosen counts, each pool's
  binding constraint, the predicted and observed load, explain()).
- `report_failure`: an interval the apiserver refused (say Forbidden on servingpools/scale) is
  a Warning Event `AutoscaleFailed` series; anything else a logged traceback.

Pure pieces (unit-tested): `planner_config`, `capacity_profile`, `replica_counts`,
`pool_counts`, `scale_patches`, `autoscaling_status`, `decision_key`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from splitserve.operator import names
from splitserve.operator.builders import POOL_PLURAL, Owner
from splitserve.operator.events import EventRecorder, now_iso
from splitserve.operator.kube import AsyncKube, KubeError, group_path
from splitserve.services.spec.serving_deployment import (API_GROUP, API_VERSION, PLURAL, POOL_NAMES, CapacityProfileSpec,
                                      SloAutoscalingSpec)
from splitserve.services.planner import (CapacityProfile, Decision, PlannerConfig, PlannerMode, PoolBounds,
                                         ReplicaCounts, SloTargets, ThroughputCurve)

log = logging.getLogger(__name__)

EVENT_REASON = "AutoscaleDecision"
FAILED_REASON = "AutoscaleFailed"
STATUS_KEY = "autoscaling"            # status.autoscaling: written here only (the reconciler leaves it)
PROFILE_PROMPT_TOKENS = 1024.0        # the x of the profile's one prefill point (the curve is flat from it)
MIN_WINDOW_S = 60.0
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


# --- one deployment's pools ----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PoolScale:
    replicas: int
    resource_version: str | None


class PoolScaling:
    """`ScaleActuator` and `DecisionReporter` of one ServingDeployment (module header)."""

    def __init__(self, kube: AsyncKube, events: EventRecorder, owner: Owner, switch_modes: bool,
                 on_scaled: Callable[[], None] = lambda: None):
        self.kube = kube
        self.events = events
        self.owner = owner
        self.switch_modes = switch_modes      # spec.autoscaling.switchModes (the task follows spec changes)
        self.on_scaled = on_scaled            # wakes the reconcile loop after a scale patch
        self.last_scale_time: str | None = None

    async def read_replicas(self) -> ReplicaCounts | None:
        scales = [await self._read_scale(pool) for pool in POOL_NAMES]
        if any(s is None for s in scales):
            return None                       # the reconciler has not created the ServingPools yet
        counts = dict(zip(POOL_NAMES, (s.replicas for s in scales)))
        return replica_counts(counts["prefill"], counts["decode"], self.switch_modes)

    async def apply(self, decision: Decision) -> None:
        """The decision's patches, the growing pool first; each one not applied is a Warning Event."""
        scaled = False
        for patch in scale_patches(self.owner.name, decision, pool_counts(decision.current)):
            outcome = await self.patch(patch)
            if outcome is None:
                scaled = True
            else:
                await self.events.record(self.owner, FAILED_REASON, f"{patch.pool} pool not scaled "
                                         f"{patch.current} -> {patch.replicas}: {outcome}", warning=True)
        if scaled:
            self.last_scale_time = now_iso()
            self.on_scaled()

    async def patch(self, patch: ScalePatch) -> str | None:
        """Patch one ServingPool's Scale while its count is still `patch.current`; None when
        applied, else why not (someone else scaled it, or the apiserver refused)."""
        for _ in range(APPLY_ATTEMPTS):
            scale = await self._read_scale(patch.pool)
            if scale is None:
                return f"ServingPool {patch.resource} is gone"
            if scale.replicas != patch.current:
                return f"ServingPool {patch.resource} was scaled to {scale.replicas} meanwhile"
            try:
                await self.kube.merge_patch(patch.path(self.owner.namespace), patch.body(scale.resource_version))
                return None
            except KubeError as exc:
                if not exc.conflict:
                    return str(exc)
        return f"ServingPool {patch.resource} kept changing ({APPLY_ATTEMPTS} conflicts)"

    async def report(self, decision: Decision) -> None:
        await self.events.record_series(self.owner, EVENT_REASON, decision.explain()[:MESSAGE_LIMIT],
                                        decision_key(decision))
        await patch_status(self.kube, self.owner, autoscaling_status(decision, now_iso(), self.last_scale_time))

    async def report_failure(self, exc: Exception) -> None:
        owner = self.owner
        if isinstance(exc, KubeError):       # e.g. Forbidden on servingpools/scale: say so on the object
            log.warning("autoscale %s/%s: %s", owner.namespace, owner.name, exc)
            await self.events.record_series(owner, FAILED_REASON, f"autoscaling interval failed: {exc}",
                                            f"kube:{exc.status}", warning=True)
        else:
            log.error("autoscale %s/%s: interval failed", owner.namespace, owner.name, exc_info=exc)

    async def _read_scale(self, pool: str) -> PoolScale | None:
        path = group_path(API_GROUP, API_VERSION, self.owner.namespace, POOL_PLURAL,
                          names.pool_resource_name(self.owner.name, pool), "scale")
        scale = await self.kube.get(path)
        if scale is None:
            return None
        return PoolScale(int((scale.get("spec") or {}).get("replicas") or 0),
                         scale["metadata"].get("resourceVersion"))


async def patch_status(kube: AsyncKube, owner: Owner, status: dict[str, Any] | None) -> None:
    """Write (None: remove) the ServingDeployment's status.autoscaling; one already gone is fine."""
    path = group_path(API_GROUP, API_VERSION, owner.namespace, PLURAL, owner.name, "status")
    try:
        await kube.merge_patch(path, {"status": {STATUS_KEY: status}})
    except KubeError as exc:
        if not exc.not_found:
            raise
