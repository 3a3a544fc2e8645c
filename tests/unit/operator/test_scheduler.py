"""The gang scheduler's pure parts: free GPUs per node, which groups wait, schedulable nodes."""

from __future__ import annotations

from splitserve.operator.builders import Owner, build_group_pods
from splitserve.operator.scheduler import node_infos, node_schedulable, not_ready_seconds, waiting_groups
from splitserve.services.spec.serving_deployment import ServingDeploymentSpec

SPEC = ServingDeploymentSpec.from_dict({"model": {"source": "m"},
                                        "decode": {"tensorParallel": 2, "gpusPerRank": 2,
                                                   "topology": {"mode": "same-label", "labelKey": "zone"}}})


def node(name, gpus, ready="True", taints=None, unschedulable=False):
    return {"metadata": {"name": name, "labels": {"zone": "a"}},
            "spec": {"taints": taints or [], "unschedulable": unschedulable},
            "status": {"allocatable": {"nvidia.com/gpu": str(gpus)},
                       "conditions": [{"type": "Ready", "status": ready}]}}


def pods(group, created="t1", node_name=None, phase="Pending"):
    docs = build_group_pods(Owner("sd", "ns", "u"), SPEC, "decode", group)
    for doc in docs:
        doc["metadata"]["creationTimestamp"] = created
        if node_name:
            doc["spec"]["nodeName"] = node_name
        doc["status"] = {"phase": phase}
    return docs


def test_free_gpus_subtract_bound_non_terminal_pods():
    bound = pods("g1", node_name="n1", phase="Running")
    done = pods("g2", node_name="n1", phase="Failed")
    [info] = node_infos([node("n1", 8)], bound + done)
    assert info.free_gpus == 4 and info.schedulable


def test_schedulable_nodes():
    assert not node_schedulable(node("n", 8, ready="False"))
    assert not node_schedulable(node("n", 8, unschedulable=True))
    assert not node_schedulable(node("n", 8, taints=[{"key": "node.kubernetes.io/not-ready", "effect": "NoExecute"}]))
    assert node_schedulable(node("n", 8, taints=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]))


def test_waiting_groups_are_complete_unbound_and_oldest_first():
    partly_bound = pods("g-bound")
    partly_bound[0]["spec"]["nodeName"] = "n1"
    incomplete = pods("g-incomplete")[:1]
    waiting = waiting_groups(pods("g-new", "t2") + pods("g-old", "t1") + partly_bound + incomplete)
    assert [w.request.key for w in waiting] == ["ns/g-old", "ns/g-new"]
    request = waiting[0].request
    assert (request.num_pods, request.gpus_per_pod, request.topology, request.label_key) == (2, 2, "same-label", "zone")
    assert waiting[0].pod_names == ["g-old-0", "g-old-1"]


def test_not_ready_seconds():
    assert not_ready_seconds(node("n", 8), now=1e9) == 0.0
    down = node("n", 8, ready="False")
    down["status"]["conditions"][0]["lastTransitionTime"] = "2026-01-01T00:00:00Z"
    since = 1767225600.0   # 2026-01-01T00:00:00Z
    assert not_ready_seconds(down, now=since + 7) == 7.0
    assert not_ready_seconds({"status": {}}, now=since) == float("inf")
