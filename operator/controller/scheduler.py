"""The `splitserve-gang` secondary scheduler: bind a worker group's pods all at once, or none.

Each pass reads nodes and bound pods, computes free `nvidia.com/gpu` per node
(allocatable minus the requests of non-terminal pods already bound there),
collects the groups whose pods ask for this scheduler and are all unbound,
asks `placement.place_groups` where each group goes (decode before prefill),
and binds every pod of a placed group through the Binding API. A group that
cannot be placed binds nothing; its reason is kept for the reconciler to put in
the ServingDeployment's status. If a bind fails midway (a pod vanished, the
apiserver refused), the whole group is rolled back: its pods are deleted and the
reconciler recreates the group, so no half-bound group ever holds GPUs.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field
from typing import Any

from splitserve.operator import names
from splitserve.operator.kube import AsyncKube, KubeError, core_path
from splitserve.operator.placement import GroupRequest, NodeInfo, place_groups, priority_order

log = logging.getLogger(__name__)
TOLERATED_TAINTS = {names.GPU_RESOURCE}
TERMINAL_PHASES = ("Succeeded", "Failed")


def _quantity(value: Any) -> int:
    text = str(value or "0")
    return int(float(text[:-1]) / 1000) if text.endswith("m") else int(float(text))


def pod_gpus(pod: dict[str, Any]) -> int:
    total = 0
    for container in pod.get("spec", {}).get("containers", []):
        resources = container.get("resources") or {}
        amount = (resources.get("requests") or {}).get(names.GPU_RESOURCE) \
            or (resources.get("limits") or {}).get(names.GPU_RESOURCE)
        total += _quantity(amount)
    return total


def node_ready(node: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in node.get("status", {}).get("conditions", []))


def not_ready_seconds(node: dict[str, Any], now: float) -> float:
    """How long the node has been NotReady (0 while Ready), from its Ready condition."""
    for c in node.get("status", {}).get("conditions", []):
        if c.get("type") == "Ready":
            if c.get("status") == "True":
                return 0.0
            since = c.get("lastTransitionTime")
            if not since:
                return float("inf")
            return max(0.0, now - dt.datetime.fromisoformat(since.replace("Z", "+00:00")).timestamp())
    return float("inf")


def node_schedulable(node: dict[str, Any]) -> bool:
    if not node_ready(node) or node.get("spec", {}).get("unschedulable"):
        return False
    return all(t.get("key") in TOLERATED_TAINTS or t.get("effect") == "PreferNoSchedule"
               for t in node.get("spec", {}).get("taints") or [])


def node_infos(nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> list[NodeInfo]:
    used: dict[str, int] = {}
    for pod in pods:
        node = pod.get("spec", {}).get("nodeName")
        if node and pod.get("status", {}).get("phase") not in TERMINAL_PHASES:
            used[node] = used.get(node, 0) + pod_gpus(pod)
    infos = []
    for node in nodes:
        name = node["metadata"]["name"]
        allocatable = _quantity((node.get("status", {}).get("allocatable") or {}).get(names.GPU_RESOURCE))
        infos.append(NodeInfo(name=name, free_gpus=allocatable - used.get(name, 0),
                              labels=dict(node["metadata"].get("labels") or {}),
                              schedulable=node_schedulable(node)))
    return infos


@dataclass(slots=True)
class WaitingGroup:
    request: GroupRequest
    namespace: str
    pod_names: list[str]          # by rank
    created: str


def waiting_groups(pods: list[dict[str, Any]]) -> list[WaitingGroup]:
    """Groups whose every pod is unbound, not being deleted, and complete (all ranks exist)."""
    by_key: dict[str, list[dict[str, Any]]] = {}
    for pod in pods:
        meta = pod["metadata"]
        group = (meta.get("labels") or {}).get(names.LABEL_GROUP)
        if group and pod.get("spec", {}).get("schedulerName") == names.SCHEDULER_NAME:
            by_key.setdefault(f"{meta['namespace']}/{group}", []).append(pod)
    waiting = []
    for key, members in by_key.items():
        size = int((members[0]["metadata"].get("annotations") or {}).get(names.ANN_GROUP_SIZE, "1"))
        if len(members) != size or any(p["spec"].get("nodeName") or p["metadata"].get("deletionTimestamp")
                                       for p in members):
            continue
        members.sort(key=lambda p: int(p["metadata"]["labels"].get(names.LABEL_RANK, "0")))
        topology = (members[0]["metadata"].get("annotations") or {}).get(names.ANN_TOPOLOGY, "same-node")
        mode, _, label_key = topology.partition("=")
        labels = members[0]["metadata"]["labels"]
        waiting.append(WaitingGroup(
            request=GroupRequest(key=key, pool=labels.get(names.LABEL_POOL, ""), num_pods=size,
                                 gpus_per_pod=pod_gpus(members[0]), topology=mode, label_key=label_key or None),
            namespace=members[0]["metadata"]["namespace"], pod_names=[p["metadata"]["name"] for p in members],
            created=min(p["metadata"].get("creationTimestamp", "") for p in members)))
    waiting.sort(key=lambda w: (w.created, w.request.key))
    return waiting


@dataclass(slots=True)
class PassResult:
    bound: dict[str, list[str]] = field(default_factory=dict)       # key -> nodes
    unschedulable: dict[str, str] = field(default_factory=dict)     # key -> reason
    rolled_back: dict[str, str] = field(default_factory=dict)       # key -> error


class GangScheduler:
    def __init__(self, kube: AsyncKube, namespaces: list[str] | None = None):
        self.kube = kube
        self.namespaces = namespaces or []    # fallback when pods cannot be listed cluster-wide
        self.reasons: dict[str, str] = {}     # key -> latest reason it waits (read by the reconciler)
        self._warned_forbidden = False

    async def _all_pods(self) -> list[dict[str, Any]]:
        """Every pod (GPU accounting must see pods of all namespaces on a node). Without
        cluster-wide list permission, only the watched namespaces' pods, with a warning:
        GPUs used by pods elsewhere are then invisible."""
        try:
            return await self.kube.list(core_path(None, "pods"))
        except KubeError as exc:
            if exc.status != 403 or not self.namespaces:
                raise
            if not self._warned_forbidden:
                log.warning("cannot list pods cluster-wide (%s); counting GPUs of pods in %s only",
                            exc.message, ", ".join(self.namespaces))
                self._warned_forbidden = True
        pods: list[dict[str, Any]] = []
        for namespace in self.namespaces:
            pods += await self.kube.list(core_path(namespace, "pods"))
        return pods

    async def run_pass(self) -> PassResult:
        nodes = await self.kube.list(core_path(None, "nodes"))
        pods = await self._all_pods()
        waiting = waiting_groups(pods)
        result = PassResult()
        if not waiting:
            self.reasons = {}
            return result
        by_key = {w.request.key: w for w in waiting}
        placement = place_groups(priority_order([w.request for w in waiting]), node_infos(nodes, pods))
        for key, nodes_for_ranks in placement.assignments.items():
            error = await self._bind_group(by_key[key], nodes_for_ranks)
            if error is None:
                result.bound[key] = nodes_for_ranks
            else:
                result.rolled_back[key] = error
        result.unschedulable = dict(placement.reasons)
        self.reasons = dict(placement.reasons)
        return result

    async def _bind_group(self, group: WaitingGroup, nodes_for_ranks: list[str]) -> str | None:
        """Bind every rank; on the first failure delete the whole group (rollback)."""
        for pod_name, node in zip(group.pod_names, nodes_for_ranks):
            body = {"apiVersion": "v1", "kind": "Binding",
                    "metadata": {"name": pod_name, "namespace": group.namespace},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
            try:
                await self.kube.create(core_path(group.namespace, "pods", pod_name, "binding"), body)
            except KubeError as exc:
                log.warning("gang %s: binding %s to %s failed (%s); rolling the group back",
                            group.request.key, pod_name, node, exc)
                for name in group.pod_names:
                    await self.kube.delete(core_path(group.namespace, "pods", name), grace_period_s=0)
                return str(exc)
        log.info("gang %s: bound %s", group.request.key, ", ".join(
            f"{p}->{n}" for p, n in zip(group.pod_names, nodes_for_ranks)))
        return None
