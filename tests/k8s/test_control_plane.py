"""Smoke tests of the real control plane: kwok GPU nodes, the default scheduler,
the node lifecycle controller. If these fail, nothing else in tests/k8s can pass."""

from __future__ import annotations

import secrets

from kubernetes import client

from cluster import wait_until
from controlplane import KubeCluster


def _node_name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def _pod(name: str, node: str | None, gpus: int) -> dict:
    spec: dict = {
        "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                        "resources": {"requests": {"cpu": "100m", "nvidia.com/gpu": str(gpus)},
                                      "limits": {"nvidia.com/gpu": str(gpus)}}}],
        "terminationGracePeriodSeconds": 0,
    }
    if node is not None:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def test_gpu_nodes_are_ready_with_capacity_and_topology(kube_cluster: KubeCluster):
    core = client.CoreV1Api(kube_cluster.api_client())
    names = [_node_name("smoke-gpu") for _ in range(2)]
    try:
        kube_cluster.add_gpu_node(names[0], gpus=8, labels={"topology.kubernetes.io/zone": "zone-a"})
        kube_cluster.add_gpu_node(names[1], gpus=4, labels={"topology.kubernetes.io/zone": "zone-b",
                                                            "splitserve.io/rack": "r7"})
        first, second = core.read_node(names[0]), core.read_node(names[1])
        for node in (first, second):
            ready = [c for c in node.status.conditions if c.type == "Ready"]
            assert ready and ready[0].status == "True", node.status.conditions
        assert first.status.allocatable["nvidia.com/gpu"] == "8"
        assert second.status.capacity["nvidia.com/gpu"] == "4"
        assert first.metadata.labels["topology.kubernetes.io/zone"] == "zone-a"
        assert second.metadata.labels["splitserve.io/rack"] == "r7"
        # kubectl sees the same (the real binary, the same kubeconfig).
        out = kube_cluster.kubectl("get", "node", names[0], "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}")
        assert out.stdout == "True"
    finally:
        for n in names:
            kube_cluster.delete_node(n)


def test_default_scheduler_binds_pod_and_kwok_runs_it(kube_cluster: KubeCluster, k8s_namespace: str):
    core = client.CoreV1Api(kube_cluster.api_client())
    node = _node_name("smoke-run")
    kube_cluster.add_gpu_node(node, gpus=2)
    try:
        core.create_namespaced_pod(k8s_namespace, _pod("fits", node, gpus=2))

        def running():
            pod = core.read_namespaced_pod("fits", k8s_namespace)
            return pod if pod.status.phase == "Running" else None

        pod = wait_until(running, timeout=60, what="pod fits to be Running")
        assert pod.spec.node_name == node
        assert pod.status.pod_ip, "kwok assigns a pod IP"
        core.delete_namespaced_pod("fits", k8s_namespace, grace_period_seconds=0)
    finally:
        kube_cluster.delete_node(node)


def test_pod_asking_for_too_many_gpus_stays_pending(kube_cluster: KubeCluster, k8s_namespace: str):
    core = client.CoreV1Api(kube_cluster.api_client())
    node = _node_name("smoke-small")
    kube_cluster.add_gpu_node(node, gpus=8)
    try:
        core.create_namespaced_pod(k8s_namespace, _pod("too-big", None, gpus=64))

        def unschedulable():
            pod = core.read_namespaced_pod("too-big", k8s_namespace)
            for cond in pod.status.conditions or []:
                if cond.type == "PodScheduled" and cond.status == "False" and cond.reason == "Unschedulable":
                    return pod, cond
            return None

        pod, cond = wait_until(unschedulable, timeout=60, what="the scheduler to mark too-big Unschedulable")
        assert "Insufficient nvidia.com/gpu" in cond.message, cond.message
        assert pod.spec.node_name is None and pod.status.phase == "Pending"
    finally:
        kube_cluster.delete_node(node)


def test_node_goes_not_ready_and_back(kube_cluster: KubeCluster):
    node = _node_name("smoke-flap")
    kube_cluster.add_gpu_node(node, gpus=8)
    try:
        down = kube_cluster.set_node_ready(node, False)
        taints = {t.key for t in down.spec.taints or []}
        # The node lifecycle controller itself tainted the node: Kubernetes treats it as NotReady.
        assert taints & {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}, taints
        up = kube_cluster.set_node_ready(node, True)
        ready = [c for c in up.status.conditions if c.type == "Ready"][0]
        assert ready.status == "True"
    finally:
        kube_cluster.delete_node(node)


def test_namespaces_are_fresh_and_usable(kube_cluster: KubeCluster):
    first, second = kube_cluster.create_namespace(), kube_cluster.create_namespace()
    try:
        assert first != second
        core = client.CoreV1Api(kube_cluster.api_client())
        assert core.read_namespaced_service_account("default", first).metadata.name == "default"
    finally:
        kube_cluster.delete_namespace(first)
        kube_cluster.delete_namespace(second)
