"""Gang placement: where every pod of a worker group goes, or why it cannot go anywhere.

Pure function over plain data, so it is property-tested without a cluster.

Algorithm. Groups are taken in priority order — decode before prefill, then
oldest first (the caller's order within a pool) — and each is placed against
the GPUs still free after the groups before it. A group is placed whole or not
at all: its pods either all get a node or the group gets a reason and takes
nothing. Lower-priority groups may still use capacity a higher-priority group
could not use (a decode group too big for any node does not block a prefill
group that fits).

Topology, per group:
- `same-node`: all pods on one node with `num_pods * gpus_per_pod` free GPUs;
  best fit (the fewest GPUs left over), ties to the node name.
- `same-label`: all pods on nodes that share one value of `label_key` (nodes
  without the label are out); within the chosen domain pods fill the nodes with
  the most free GPUs first; the domain with the fewest GPUs left over wins.
- `none`: like `same-label` with the whole cluster as one domain.
Nodes that are not schedulable (NotReady, cordoned, or tainted against the
pods) take no pods.
"""

from __future__ import annotations

from dataclasses import dataclass, field

POOL_PRIORITY = {"decode": 0, "prefill": 1}


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    free_gpus: int
    labels: dict[str, str] = field(default_factory=dict)
    schedulable: bool = True


@dataclass(frozen=True, slots=True)
class GroupRequest:
    key: str                 # namespace/group
    pool: str                # decode | prefill
    num_pods: int
    gpus_per_pod: int
    topology: str = "same-node"
    label_key: str | None = None

    @property
    def num_gpus(self) -> int:
        return self.num_pods * self.gpus_per_pod


@dataclass(slots=True)
class Placement:
    assignments: dict[str, list[str]] = field(default_factory=dict)   # key -> node per rank
    reasons: dict[str, str] = field(default_factory=dict)             # key -> why it waits


def priority_order(requests: list[GroupRequest]) -> list[GroupRequest]:
    """Decode first; the caller's order (oldest first) within a pool (sort is stable)."""
    return sorted(requests, key=lambda r: POOL_PRIORITY.get(r.pool, len(POOL_PRIORITY)))


def place_groups(requests: list[GroupRequest], nodes: list[NodeInfo]) -> Placement:
    free = {n.name: n.free_gpus for n in nodes if n.schedulable}
    usable = [n for n in nodes if n.schedulable]
    result = Placement()
    for request in priority_order(requests):
        nodes_for_ranks, reason = place_one(request, usable, free)
        if nodes_for_ranks is None:
            result.reasons[request.key] = reason
            continue
        for node in nodes_for_ranks:
            free[node] -= request.gpus_per_pod
        result.assignments[request.key] = nodes_for_ranks
    return result


def place_one(request: GroupRequest, nodes: list[NodeInfo], free: dict[str, int]
              ) -> tuple[list[str] | None, str]:
    """Nodes for ranks 0..n-1 of one group, or (None, reason). Does not change `free`."""
    if request.num_pods < 1:
        return None, "group has no pods"
    if not nodes:
        return None, "no schedulable node (all NotReady, cordoned or tainted)"
    if request.topology == "same-node":
        return _place_same_node(request, nodes, free)
    if request.topology == "same-label":
        if not request.label_key:
            return None, "topology same-label needs labelKey"
        domains: dict[str, list[NodeInfo]] = {}
        for node in nodes:
            value = node.labels.get(request.label_key)
            if value is not None:
                domains.setdefault(value, []).append(node)
        if not domains:
            return None, f"no schedulable node has the label {request.label_key}"
    else:
        domains = {"": list(nodes)}
    return _place_in_domains(request, domains, free)


def _place_same_node(request: GroupRequest, nodes: list[NodeInfo], free: dict[str, int]
                     ) -> tuple[list[str] | None, str]:
    fitting = [n.name for n in nodes if free[n.name] >= request.num_gpus]
    if not fitting:
        most = max(nodes, key=lambda n: (free[n.name], n.name))
        return None, (f"no node has {request.num_gpus} free nvidia.com/gpu for {request.num_pods} pod(s) "
                      f"on one node (most free: {free[most.name]} on {most.name})")
    best = min(fitting, key=lambda name: (free[name] - request.num_gpus, name))
    return [best] * request.num_pods, ""


def _fill(request: GroupRequest, members: list[NodeInfo], free: dict[str, int]) -> list[str]:
    """Ranks onto the domain's nodes, most free GPUs first; may return fewer than num_pods."""
    chosen: list[str] = []
    for node in sorted(members, key=lambda n: (-free[n.name], n.name)):
        room = request.num_pods if request.gpus_per_pod == 0 else free[node.name] // request.gpus_per_pod
        chosen.extend([node.name] * min(room, request.num_pods - len(chosen)))
        if len(chosen) == request.num_pods:
            break
    return chosen


def _place_in_domains(request: GroupRequest, domains: dict[str, list[NodeInfo]], free: dict[str, int]
                      ) -> tuple[list[str] | None, str]:
    best: tuple[int, str, list[str]] | None = None
    most_fit, most_value = -1, ""
    for value, members in sorted(domains.items()):
        chosen = _fill(request, members, free)
        if len(chosen) > most_fit:
            most_fit, most_value = len(chosen), value
        if len(chosen) < request.num_pods:
            continue
        left_over = sum(free[n.name] for n in members) - request.num_gpus
        if best is None or (left_over, value) < (best[0], best[1]):
            best = (left_over, value, chosen)
    if best is not None:
        return best[2], ""
    where = f"{request.label_key}={most_value}" if request.topology == "same-label" else "the cluster"
    return None, (f"not enough free nvidia.com/gpu for {request.num_pods} pod(s) x {request.gpus_per_pod} GPU "
                  f"({request.topology}): the best domain, {where}, fits {most_fit}")
