"""Worker groups as observed from pods, and the per-pool plan (pure).

A group is the set of pods sharing `splitserve.io/group`. `observe_groups`
turns pod documents into `Group`s; `plan_pool` decides, from the desired group
count, the pool's current spec hash and the groups, what to do next:

- replace every failed group (a pod Failed, deleted or missing, or on a node
  that is NotReady or gone) — as a whole; a group all of whose pods are being
  deleted is already on its way out and counts for nothing;
- scale up by creating groups; scale down by draining the least useful groups
  (not ready first, then stale, then newest);
- rolling update: while a group's spec hash is stale, keep one extra
  (surge) up-to-date group; once every up-to-date group is ready, drain one
  stale group. One group at a time, never below the desired count of ready groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.operator import names


@dataclass(slots=True)
class PodState:
    name: str
    rank: int
    node: str | None
    phase: str
    ready: bool
    deleting: bool
    annotations: dict[str, str]
    pod_ip: str | None

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> PodState:
        meta, spec, status = doc["metadata"], doc.get("spec", {}), doc.get("status", {})
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []))
        return cls(name=meta["name"], rank=int(meta.get("labels", {}).get(names.LABEL_RANK, "0")),
                   node=spec.get("nodeName"), phase=status.get("phase", "Pending"), ready=ready,
                   deleting=bool(meta.get("deletionTimestamp")), annotations=dict(meta.get("annotations") or {}),
                   pod_ip=status.get("podIP"))


@dataclass(slots=True)
class Group:
    name: str
    pool: str
    size: int
    spec_hash: str
    created: str                     # oldest pod's creationTimestamp (RFC 3339 sorts as text)
    draining: bool
    pods: list[PodState] = field(default_factory=list)

    @property
    def leader(self) -> PodState | None:
        return next((p for p in self.pods if p.rank == 0), None)

    @property
    def bound(self) -> bool:
        return len(self.pods) == self.size and all(p.node for p in self.pods)

    @property
    def ready(self) -> bool:
        return len(self.pods) == self.size and all(p.ready and not p.deleting for p in self.pods)

    @property
    def drain_state(self) -> str:
        leader = self.leader
        return leader.annotations.get(names.ANN_DRAIN_STATE, "") if leader else ""

    @property
    def leaving(self) -> bool:
        """Every pod is being deleted: the group is on its way out (replaced already)."""
        return bool(self.pods) and all(p.deleting for p in self.pods)

    def leaves_gracefully(self, node_ready: dict[str, bool]) -> bool:
        """A pod is being deleted (kubectl delete, an eviction) while every pod is alive on a
        Ready node: the group goes with its grace periods, so that rank 0 drains through its
        SIGTERM (its streams migrate) while the other ranks, which wait for rank 0, serve it."""
        return (any(p.deleting for p in self.pods) and not any(p.phase == "Failed" for p in self.pods)
                and all(p.node is None or node_ready.get(p.node, False) for p in self.pods))

    def failure(self, node_ready: dict[str, bool]) -> str | None:
        """Why this group must be replaced, or None while it is healthy (or still starting)."""
        for pod in sorted(self.pods, key=lambda p: p.rank):
            if pod.phase == "Failed":
                return f"pod {pod.name} failed"
            if pod.deleting:
                return f"pod {pod.name} is being deleted"
            if pod.node and not node_ready.get(pod.node, False):
                state = "is NotReady" if pod.node in node_ready else "is gone"
                return f"node {pod.node} of pod {pod.name} {state}"
        if len(self.pods) < self.size:
            present = {p.rank for p in self.pods}
            missing = [r for r in range(self.size) if r not in present]
            return f"rank(s) {', '.join(map(str, missing))} missing"
        return None


def observe_groups(pods: list[dict[str, Any]]) -> dict[str, list[Group]]:
    """Pool name -> its groups (oldest first), from the deployment's worker pods."""
    by_name: dict[str, Group] = {}
    for doc in pods:
        meta = doc["metadata"]
        labels = meta.get("labels") or {}
        name = labels.get(names.LABEL_GROUP)
        if not name:
            continue
        group = by_name.get(name)
        if group is None:
            annotations = meta.get("annotations") or {}
            group = by_name[name] = Group(
                name=name, pool=labels.get(names.LABEL_POOL, ""),
                size=int(annotations.get(names.ANN_GROUP_SIZE, "1")),
                spec_hash=labels.get(names.LABEL_SPEC_HASH, ""), created=meta.get("creationTimestamp", ""),
                draining=labels.get(names.LABEL_DRAINING) == "true")
        group.created = min(group.created, meta.get("creationTimestamp", "")) or group.created
        group.draining = group.draining or labels.get(names.LABEL_DRAINING) == "true"
        group.pods.append(PodState.from_doc(doc))
    pools: dict[str, list[Group]] = {}
    for group in sorted(by_name.values(), key=lambda g: (g.created, g.name)):
        pools.setdefault(group.pool, []).append(group)
    return pools


@dataclass(slots=True)
class PoolPlan:
    num_create: int = 0
    replace: list[tuple[str, str]] = field(default_factory=list)   # (group, reason)
    drain: list[tuple[str, str]] = field(default_factory=list)     # (group, ScaleDown | RollingUpdate)


def plan_pool(desired: int, spec_hash: str, groups: list[Group], node_ready: dict[str, bool]) -> PoolPlan:
    plan = PoolPlan()
    active: list[Group] = []
    for group in groups:
        if group.draining or group.leaving:
            continue
        reason = group.failure(node_ready)
        if reason is not None:
            plan.replace.append((group.name, reason))
        else:
            active.append(group)
    # A replaced group is deleted and a fresh one created in its place.
    num_active = len(active) + len(plan.replace)
    stale = [g for g in active if g.spec_hash != spec_hash]
    current = [g for g in active if g.spec_hash == spec_hash]
    rolling_drain_busy = any(g.draining for g in groups)
    target = desired + (1 if stale and desired > 0 else 0)
    if num_active < target:
        plan.num_create = target - num_active
        return plan
    if stale and desired > 0 and num_active > desired:
        if not rolling_drain_busy and current and all(g.ready for g in current):
            victim = min(stale, key=lambda g: (g.ready, g.created, g.name))
            plan.drain.append((victim.name, "RollingUpdate"))
        return plan
    excess = num_active - desired
    if excess > 0:
        # Not ready first, then stale, then newest.
        order = sorted(active, key=lambda g: (g.ready, g.spec_hash == spec_hash, _neg(g.created), g.name))
        plan.drain.extend((g.name, "ScaleDown") for g in order[:excess])
    return plan


def _neg(text: str) -> tuple[int, ...]:
    return tuple(-ord(c) for c in text)
