"""Reconcile one ServingDeployment: children, worker groups, drains, status.

Level-triggered and idempotent: each pass reads the current state (the
ServingDeployment, its pods, the nodes) and moves it one step toward the spec,
so a pass can be repeated or interrupted at any point. Order of a pass:

1. parse the spec (a bad one only updates status: the CRD schema rejects most);
2. apply the children: ConfigMap, headless workers Service, frontend
   Deployment + Service, one ServingPool per pool (kept in sync both ways);
3. per pool, `groups.plan_pool`: replace failed groups, create, start drains;
4. move draining groups on: Drain RPC + Stats until idle or the drain timeout
   (→ drained), then delete (→ deleting, gone);
5. write status (ready/desired per pool, group phases, conditions).
Every step that changes something posts an Event.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from splitserve.operator import builders, names
from splitserve.operator.builders import Owner
from splitserve.operator.drain import drain_and_measure, worker_address
from splitserve.operator.events import EventRecorder, now_iso
from splitserve.operator.groups import Group, observe_groups, plan_pool
from splitserve.operator.kube import AsyncKube, KubeError, core_path, group_path
from splitserve.operator.scheduler import GangScheduler
from splitserve.services.spec.serving_deployment import API_GROUP, API_VERSION, PLURAL, POOL_NAMES, ServingDeploymentSpec
from splitserve.operator.status import Observed, build_status, pool_status, reconciler_owned

log = logging.getLogger(__name__)


def _sd_path(owner: Owner, sub: str | None = None) -> str:
    return group_path(API_GROUP, API_VERSION, owner.namespace, PLURAL, owner.name, sub)


class Reconciler:
    def __init__(self, kube: AsyncKube, scheduler: GangScheduler, events: EventRecorder, etcd_endpoints: list[str],
                 use_pod_ip: bool = True, workload: builders.WorkloadOptions = builders.WorkloadOptions()):
        self.kube = kube
        self.use_pod_ip = use_pod_ip
        self.scheduler = scheduler
        self.events = events
        self.etcd_endpoints = etcd_endpoints
        self.workload = workload          # what every pod it creates gets (etcd client TLS)
        self._announced: dict[str, str] = {}     # group key -> last unschedulable reason posted

    async def reconcile(self, body: dict[str, Any], node_ready: dict[str, bool]) -> None:
        owner = Owner.from_body(body)
        generation = body["metadata"].get("generation", 0)
        try:
            spec = ServingDeploymentSpec.from_dict(body.get("spec"))
        except ValueError as exc:
            await self.events.record(owner, "InvalidSpec", str(exc), warning=True)
            await self._write_status(owner, body, Observed(generation, {}, 0, 0, spec_error=str(exc)))
            return
        await self._apply_children(owner, spec)
        desired = {pool: await self._sync_pool_replicas(owner, body, spec, pool) for pool in POOL_NAMES}
        pods = await self.kube.list(core_path(owner.namespace, "pods"),
                                    label_selector=f"{names.LABEL_DEPLOYMENT}={owner.name},{names.LABEL_GROUP}")
        pools = observe_groups(pods)
        failures: list[str] = []
        for pool in POOL_NAMES:
            failures += await self._step_pool(owner, spec, pool, desired[pool], pools.get(pool, []), node_ready)
        # Re-read: this pass created, replaced or relabelled pods.
        pods = await self.kube.list(core_path(owner.namespace, "pods"),
                                    label_selector=f"{names.LABEL_DEPLOYMENT}={owner.name},{names.LABEL_GROUP}")
        pools = observe_groups(pods)
        reasons = {key.split("/", 1)[1]: reason for key, reason in self.scheduler.reasons.items()
                   if key.startswith(f"{owner.namespace}/")}
        await self._announce_unschedulable(owner, reasons)
        frontend = await self.kube.get(group_path("apps", "v1", owner.namespace, "deployments",
                                                  names.frontend_name(owner.name))) or {}
        observed = Observed(generation=generation,
                            pools={p: pool_status(desired[p], pools.get(p, []), reasons) for p in POOL_NAMES},
                            frontend_ready=(frontend.get("status") or {}).get("readyReplicas", 0),
                            frontend_desired=spec.frontend.replicas, failures=failures)
        await self._write_status(owner, body, observed)
        await self._write_pool_status(owner, pools)

    # --- children ------------------------------------------------------------------------

    async def _apply_children(self, owner: Owner, spec: ServingDeploymentSpec) -> None:
        ns = owner.namespace
        await self._apply(owner, core_path(ns, "configmaps"),
                          builders.build_config_map(owner, spec, self.etcd_endpoints))
        await self._apply(owner, core_path(ns, "services"), builders.build_workers_service(owner))
        await self._apply(owner, group_path("apps", "v1", ns, "deployments"),
                          builders.build_frontend_deployment(owner, spec, self.workload))
        await self._apply(owner, core_path(ns, "services"), builders.build_frontend_service(owner, spec))

    async def _apply(self, owner: Owner, collection: str, doc: dict[str, Any]) -> None:
        """Create, or merge-patch when what the operator last wrote differs (not on every pass)."""
        digest = builders.content_hash(doc)
        doc["metadata"].setdefault("annotations", {})[names.ANN_APPLIED_HASH] = digest
        name, kind = doc["metadata"]["name"], doc["kind"]
        current = await self.kube.get(f"{collection}/{name}")
        if current is None:
            await self.kube.create(collection, doc)
            await self.events.record(owner, "Created", f"created {kind} {name}")
        elif (current["metadata"].get("annotations") or {}).get(names.ANN_APPLIED_HASH) != digest:
            await self.kube.merge_patch(f"{collection}/{name}", doc)
            await self.events.record(owner, "Updated", f"updated {kind} {name}")

    async def _sync_pool_replicas(self, owner: Owner, body: dict[str, Any], spec: ServingDeploymentSpec,
                                  pool: str) -> int:
        """The pool's desired group count, keeping ServingPool and ServingDeployment in step:
        a `kubectl scale` of either one wins over the value both had last agreed on."""
        path = group_path(API_GROUP, API_VERSION, owner.namespace, builders.POOL_PLURAL,
                          names.pool_resource_name(owner.name, pool))
        sd_value = spec.pool(pool).replicas
        child = await self.kube.get(path)
        if child is None:
            await self.kube.create(path.rsplit("/", 1)[0], builders.build_serving_pool(owner, pool, sd_value))
            await self.events.record(owner, "Created", f"created ServingPool {path.rsplit('/', 1)[1]}")
            return sd_value
        synced = int((child["metadata"].get("annotations") or {}).get(names.ANN_SYNCED_REPLICAS, sd_value))
        pool_value = int(child.get("spec", {}).get("replicas", sd_value))
        if pool_value != synced:
            await self.kube.merge_patch(_sd_path(owner), {"spec": {pool: {"replicas": pool_value}}})
            await self.kube.merge_patch(path, {"metadata": {"annotations": {
                names.ANN_SYNCED_REPLICAS: str(pool_value)}}})
            await self.events.record(owner, "Scaled", f"{pool} pool scaled to {pool_value} group(s) "
                                                      f"through ServingPool {child['metadata']['name']}")
            return pool_value
        if sd_value != synced:
            await self.kube.merge_patch(path, {"spec": {"replicas": sd_value}, "metadata": {"annotations": {
                names.ANN_SYNCED_REPLICAS: str(sd_value)}}})
            await self.events.record(owner, "Scaled", f"{pool} pool scaled to {sd_value} group(s)")
        return sd_value

    # --- worker groups -------------------------------------------------------------------

    async def _step_pool(self, owner: Owner, spec: ServingDeploymentSpec, pool: str, desired: int,
                         groups: list[Group], node_ready: dict[str, bool]) -> list[str]:
        plan = plan_pool(desired, builders.pool_spec_hash(spec, pool), groups, node_ready)
        by_name = {g.name: g for g in groups}
        failures = []
        for name, reason in plan.replace:
            failures.append(f"{name}: {reason}")
            # A dead group goes at once; one that a user or an eviction is deleting keeps its
            # grace periods (rank 0 drains and hands its streams over to other groups).
            graceful = by_name[name].leaves_gracefully(node_ready)
            await self._delete_group(owner.namespace, by_name[name], grace_period_s=None if graceful else 0)
            await self.events.record(owner, "GroupFailed", f"replacing {pool} group {name} as a whole: {reason}",
                                     warning=True)
            await self._create_group(owner, spec, pool)
        for _ in range(plan.num_create):
            await self._create_group(owner, spec, pool)
        for name, reason in plan.drain:
            await self._start_drain(owner, by_name[name], reason)
        for group in groups:
            if group.draining:
                await self._advance_drain(owner, spec, group)
        return failures

    async def _create_group(self, owner: Owner, spec: ServingDeploymentSpec, pool: str) -> None:
        group = names.new_group_name(owner.name, pool)
        for pod in builders.build_group_pods(owner, spec, pool, group, self.workload):
            await self.kube.create(core_path(owner.namespace, "pods"), pod)
        await self.events.record(owner, "GroupCreated", f"created {pool} group {group} "
                                                        f"({spec.pool(pool).group_size} pod(s))")

    async def _delete_group(self, namespace: str, group: Group, grace_period_s: int | None = None) -> None:
        for pod in group.pods:
            if not pod.deleting or grace_period_s == 0:
                await self.kube.delete(core_path(namespace, "pods", pod.name), grace_period_s)

    async def _start_drain(self, owner: Owner, group: Group, reason: str) -> None:
        patch = {"metadata": {"labels": {names.LABEL_DRAINING: "true"}, "annotations": {
            names.ANN_DRAIN_STATE: "draining", names.ANN_DRAIN_STARTED: f"{time.time():.3f}",
            names.ANN_DRAIN_REASON: reason}}}
        for pod in group.pods:
            await self.kube.merge_patch(core_path(owner.namespace, "pods", pod.name), patch)
        leader = group.leader
        if leader is not None:   # tell the worker now, so routers stop sending it work at once
            address = worker_address(leader, self.use_pod_ip)
            if address:
                await drain_and_measure(address)
        await self.events.record(owner, "Draining", f"draining {group.pool} group {group.name} ({reason})")

    async def _advance_drain(self, owner: Owner, spec: ServingDeploymentSpec, group: Group) -> None:
        leader = group.leader
        if any(p.deleting for p in group.pods) or leader is None:
            return
        if group.drain_state == "drained":
            await self._delete_group(owner.namespace, group)
            await self.events.record(owner, "Deleted", f"deleted drained {group.pool} group {group.name}")
            return
        started = float(leader.annotations.get(names.ANN_DRAIN_STARTED, "0") or 0)
        waited = time.time() - started
        address = worker_address(leader, self.use_pod_ip)
        load = await drain_and_measure(address) if address else None
        if load is not None and not load.idle and waited < spec.drain_timeout_seconds:
            return
        if load is None:
            note = "worker unreachable, nothing in flight there"
        elif load.idle:
            note = f"no request in flight after {waited:.1f} s"
        else:
            note = f"drain timeout ({spec.drain_timeout_seconds} s) with {load.num_in_flight} request(s) in flight"
        await self.kube.merge_patch(core_path(owner.namespace, "pods", leader.name),
                                    {"metadata": {"annotations": {names.ANN_DRAIN_STATE: "drained"}}})
        await self.events.record(owner, "Drained", f"{group.pool} group {group.name} drained: {note}",
                                 warning=load is not None and not load.idle)

    # --- status --------------------------------------------------------------------------

    async def _announce_unschedulable(self, owner: Owner, reasons: dict[str, str]) -> None:
        for group, reason in reasons.items():
            key = f"{owner.namespace}/{group}"
            if self._announced.get(key) != reason:
                self._announced[key] = reason
                await self.events.record(owner, "Unschedulable", f"group {group} waits: {reason}", warning=True)

    async def _write_status(self, owner: Owner, body: dict[str, Any], observed: Observed) -> None:
        previous = reconciler_owned(body.get("status") or {})
        status = build_status(observed, previous, now_iso())
        if status != previous:       # a merge patch: status.autoscaling (the autoscaler's) stays
            try:
                await self.kube.merge_patch(_sd_path(owner, "status"), {"status": status})
            except KubeError as exc:
                if not exc.not_found:
                    raise

    async def _write_pool_status(self, owner: Owner, pools: dict[str, list[Group]]) -> None:
        for pool in POOL_NAMES:
            groups = [g for g in pools.get(pool, []) if not g.draining]
            status = {"replicas": len(groups), "readyReplicas": sum(1 for g in groups if g.ready),
                      "selector": f"{names.LABEL_DEPLOYMENT}={owner.name},{names.LABEL_POOL}={pool},"
                                  f"{names.LABEL_RANK}=0"}
            path = group_path(API_GROUP, API_VERSION, owner.namespace, builders.POOL_PLURAL,
                              names.pool_resource_name(owner.name, pool), "status")
            try:
                await self.kube.merge_patch(path, {"status": status})
            except KubeError as exc:
                if not exc.not_found:
                    raise
