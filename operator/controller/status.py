"""The ServingDeployment's status, built from what the reconciler observed (pure).

Per pool: `desired` groups, `ready` groups, `current` groups (not draining) and
each group's phase — Pending (with the gang scheduler's reason), Starting,
Ready, Draining, Drained, Deleting. Conditions follow the Kubernetes convention:
Ready, Progressing and Degraded, each keeping its lastTransitionTime while its
status stays the same.

`status.autoscaling` is the autoscaler's (pool_scaling.py): the reconciler neither writes nor
compares it (`reconciler_owned`), so neither overwrites the other's newer value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.operator.groups import Group
from splitserve.services.spec.serving_deployment import Condition, GroupStatus, PoolStatus


def group_phase(group: Group, pending_reason: str | None) -> GroupStatus:
    if group.draining:
        if any(p.deleting for p in group.pods):
            return GroupStatus(group.name, "Deleting")
        state = group.drain_state or "draining"
        return GroupStatus(group.name, "Drained" if state == "drained" else "Draining")
    if not group.bound:
        return GroupStatus(group.name, "Pending", pending_reason or "waiting for the gang scheduler")
    return GroupStatus(group.name, "Ready" if group.ready else "Starting")


def pool_status(desired: int, groups: list[Group], pending_reasons: dict[str, str]) -> PoolStatus:
    phases = tuple(group_phase(g, pending_reasons.get(g.name)) for g in groups)
    return PoolStatus(ready=sum(1 for p in phases if p.phase == "Ready"), desired=desired,
                      groups=phases)


@dataclass(slots=True)
class Observed:
    generation: int
    pools: dict[str, PoolStatus]
    frontend_ready: int
    frontend_desired: int
    spec_error: str | None = None
    failures: list[str] = field(default_factory=list)     # groups replaced this pass, with reasons


def conditions(observed: Observed, previous: list[dict[str, Any]], now: str) -> list[dict[str, Any]]:
    old = {c.get("type"): c for c in previous or []}

    def make(kind: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
        status = "True" if ok else "False"
        prior = old.get(kind)
        since = prior.get("lastTransitionTime", now) if prior and prior.get("status") == status else now
        return Condition(kind, status, reason, message, since).to_dict()

    if observed.spec_error:
        return [make("Ready", False, "InvalidSpec", observed.spec_error),
                make("Progressing", False, "InvalidSpec", observed.spec_error),
                make("Degraded", True, "InvalidSpec", observed.spec_error)]
    pending = [f"{g.name}: {g.reason}" for p in observed.pools.values() for g in p.groups if g.phase == "Pending"]
    moving = [g.name for p in observed.pools.values() for g in p.groups
              if g.phase in ("Starting", "Draining", "Drained", "Deleting")]
    all_ready = all(p.ready == p.desired and len(p.groups) == p.desired for p in observed.pools.values()) \
        and observed.frontend_ready >= observed.frontend_desired
    summary = ", ".join(f"{name} {p.ready}/{p.desired}" for name, p in observed.pools.items())
    degraded = pending + observed.failures
    return [
        make("Ready", all_ready, "AllGroupsReady" if all_ready else "GroupsNotReady",
             f"{summary}, frontend {observed.frontend_ready}/{observed.frontend_desired}"),
        make("Progressing", bool(moving or pending), "Reconciling" if moving or pending else "Stable",
             "; ".join(moving + pending)[:1000]),
        make("Degraded", bool(degraded), "Unschedulable" if pending else ("GroupReplaced" if degraded else "Healthy"),
             "; ".join(degraded)[:1000]),
    ]


WRITTEN_ELSEWHERE = ("autoscaling",)     # status keys another writer owns (merge patches leave them)


def reconciler_owned(status: dict[str, Any]) -> dict[str, Any]:
    """The part of a status the reconciler writes: what `build_status` is compared with."""
    return {k: v for k, v in status.items() if k not in WRITTEN_ELSEWHERE}


def build_status(observed: Observed, previous: dict[str, Any], now: str) -> dict[str, Any]:
    status: dict[str, Any] = {"observedGeneration": observed.generation,
                              "conditions": conditions(observed, previous.get("conditions", []), now),
                              "frontend": {"ready": observed.frontend_ready, "desired": observed.frontend_desired}}
    for name, pool in observed.pools.items():
        status[name] = {**pool.to_dict(), "current": sum(1 for g in pool.groups
                                                         if g.phase in ("Pending", "Starting", "Ready"))}
    return status
