"""Networking of the test node agent's pods on the real control plane: pod IPs
reachable over the node bridge, across linked nodes, headless-Service names in
/etc/hosts, and a real `splitserve worker` pod registering in the control
plane's etcd (through the node's host-port forward) and answering the
operator's canary on its pod IP."""

from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from cluster import wait_until
from controlplane import KubeCluster
from node_agent import NodeAgent, TOLERATION, new_cluster_network
from node_agent_workloads import PORT, get_in_netns, is_ready, next_pod_cidr, server_pod, wait_pod, wait_pod_gone


def test_pods_of_the_node_reach_each_other(kube_cluster: KubeCluster, node_agent: NodeAgent,
                                           k8s_namespace: str, tmp_path: Path):
    core = kube_cluster.core()
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        core.create_namespaced_pod(k8s_namespace, server_pod(name, node_agent.node_name, tmp_path / name))
    a, b = (wait_pod(core, k8s_namespace, n, "Running and Ready", is_ready) for n in ("a", "b"))
    assert a.status.pod_ip != b.status.pod_ip
    # From inside pod a's namespace to pod b's IP, over the node bridge.
    code, body = get_in_netns(node_agent.pod_netns(k8s_namespace, "a"), b.status.pod_ip, PORT)
    assert code == 200 and body["env"]["HOSTNAME"] == "b"


def test_headless_service_names_resolve_in_pods(kube_cluster: KubeCluster, node_agent: NodeAgent,
                                                k8s_namespace: str, tmp_path: Path):
    core = kube_cluster.core()
    core.create_namespaced_service(k8s_namespace, {
        "metadata": {"name": "grp"},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"app": "grp"},
                 "ports": [{"name": "http", "port": PORT}]}})
    for name in ("rank-0", "rank-1"):
        (tmp_path / name).mkdir()
        pod = server_pod(name, node_agent.node_name, tmp_path / name)
        pod["metadata"]["labels"] = {"app": "grp"}
        pod["spec"].update({"hostname": name, "subdomain": "grp"})
        core.create_namespaced_pod(k8s_namespace, pod)
    leader, follower = (wait_pod(core, k8s_namespace, n, "Running and Ready", is_ready) for n in ("rank-0", "rank-1"))
    fqdn = f"rank-0.grp.{k8s_namespace}.svc.cluster.local"     # the operator's leader address form

    def resolved() -> str | None:
        _, body = get_in_netns(node_agent.node_netns, follower.status.pod_ip, PORT, f"/resolve/{fqdn}")
        return body["address"] if body["address"] == leader.status.pod_ip else None

    wait_until(resolved, timeout=10, what=f"{fqdn} to resolve to {leader.status.pod_ip} inside rank-1")
    _, short = get_in_netns(node_agent.node_netns, follower.status.pod_ip, PORT, "/resolve/rank-0.grp")
    assert short["address"] == leader.status.pod_ip
    _, none = get_in_netns(node_agent.node_netns, follower.status.pod_ip, PORT, "/resolve/nope.grp")
    assert none["address"].startswith("error")         # no DNS behind it: fails, and at once


def test_pods_on_two_linked_nodes_reach_and_name_each_other(kube_cluster: KubeCluster, k8s_namespace: str,
                                                            tmp_path: Path):
    core = kube_cluster.core()
    network = new_cluster_network()
    agents: list[NodeAgent] = []
    try:
        for i in range(2):
            agents.append(NodeAgent(kube_cluster.api_client(), f"agent-{secrets.token_hex(3)}",
                                    tmp_path / f"agent{i}", gpus=1, pod_cidr=next_pod_cidr(),
                                    cluster=network).start())
        core.create_namespaced_service(k8s_namespace, {
            "metadata": {"name": "grp"},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"app": "grp"}}})
        for i, agent in enumerate(agents):
            (tmp_path / f"r{i}").mkdir()
            pod = server_pod(f"r{i}", agent.node_name, tmp_path / f"r{i}")
            pod["metadata"]["labels"] = {"app": "grp"}
            pod["spec"].update({"hostname": f"r{i}", "subdomain": "grp"})
            core.create_namespaced_pod(k8s_namespace, pod)
        r0, r1 = (wait_pod(core, k8s_namespace, f"r{i}", "Running and Ready", is_ready) for i in range(2))
        assert r0.spec.node_name != r1.spec.node_name
        # Pod to pod across nodes: r0's namespace -> node 0 -> cluster bridge -> node 1 -> r1.
        code, body = get_in_netns(agents[0].pod_netns(k8s_namespace, "r0"), r1.status.pod_ip, PORT)
        assert code == 200 and body["env"]["HOSTNAME"] == "r1"
        fqdn = f"r1.grp.{k8s_namespace}.svc.cluster.local"

        def resolved() -> bool:
            _, answer = get_in_netns(agents[0].node_netns, r0.status.pod_ip, PORT, f"/resolve/{fqdn}")
            return answer["address"] == r1.status.pod_ip

        wait_until(resolved, timeout=10, what=f"{fqdn} to resolve inside r0 (on the other node)")
    finally:
        for agent in agents:
            agent.stop()
            kube_cluster.delete_node(agent.node_name)
        network.destroy()
    assert not any(errors for errors in (a.errors for a in agents)), [a.errors for a in agents]


def _etcd_port(cluster: KubeCluster) -> int:
    etcd = next(c for c in cluster.components if c.name == "etcd")
    return int(etcd.argv[etcd.argv.index("--listen-client-urls") + 1].rsplit(":", 1)[1])


def _etcd_values(cluster: KubeCluster, prefix: str) -> list[str]:
    """Values under `prefix` in the control plane's etcd, read from the host (etcd's JSON gateway)."""
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    body = json.dumps({"key": b64(prefix.encode()), "range_end": b64(prefix[:-1].encode() + bytes([ord(prefix[-1]) + 1]))})
    req = urllib.request.Request(f"http://127.0.0.1:{_etcd_port(cluster)}/v3/kv/range", body.encode(), method="POST")
    with urllib.request.urlopen(req, timeout=5) as resp:
        return [base64.b64decode(kv["value"]).decode() for kv in json.load(resp).get("kvs", [])]


def test_a_real_splitserve_worker_pod_registers_and_serves(kube_cluster: KubeCluster, node_agent: NodeAgent,
                                                           k8s_namespace: str, llama_dir: Path):
    """A worker shaped like the operator's rank-0 pod (entrypoint splitserve, POD_IP/POD_NAME from
    fieldRefs, --advertise-host $(POD_IP), gRPC startup probe, the operator's exec canary as
    readiness) registers in the control plane's etcd through the node's forward, and answers the
    canary on its pod IP from another namespace."""
    from splitserve.operator.builders import probe_command

    core = kube_cluster.core()
    etcd = node_agent.expose_host_port(_etcd_port(kube_cluster))
    container = {
        "name": "worker", "image": "splitserve:test", "command": ["splitserve"],
        "args": ["worker", "--model", str(llama_dir), "--host", "0.0.0.0", "--advertise-host", "$(POD_IP)",
                 "--port", "50051", "--threads", "1", "--kv-cache-gib", "0.05", "--worker-id", "$(POD_NAME)",
                 "--etcd", "$(SPLITSERVE_ETCD)", "--etcd-prefix", f"/{k8s_namespace}/workers/"],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "SPLITSERVE_ETCD", "value": etcd},
                {"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "PYTHONUNBUFFERED", "value": "1"}],
        "startupProbe": {"grpc": {"port": 50051}, "periodSeconds": 1, "failureThreshold": 150},
        "readinessProbe": {"exec": {"command": probe_command()}, "periodSeconds": 2, "timeoutSeconds": 20}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "worker-0"},
           "spec": {"containers": [container], "nodeName": node_agent.node_name, "tolerations": [TOLERATION],
                    "terminationGracePeriodSeconds": 30}}
    t0 = time.monotonic()
    core.create_namespaced_pod(k8s_namespace, pod)
    try:
        ready = wait_pod(core, k8s_namespace, "worker-0", "Running and Ready", is_ready, timeout=150)
    except TimeoutError:
        raise AssertionError(node_agent.container_log(k8s_namespace, "worker-0")[-4000:]) from None
    print(f"worker pod Ready after {time.monotonic() - t0:.1f} s")
    assert ready.status.container_statuses[0].restart_count == 0
    records = wait_until(lambda: _etcd_values(kube_cluster, f"/{k8s_namespace}/workers/"), timeout=20,
                         what="the worker's etcd record")
    assert len(records) == 1 and f"{ready.status.pod_ip}:50051" in records[0], records
    assert "worker-0" in records[0]                       # --worker-id $(POD_NAME)
    # The operator's canary from another namespace (the node's), to the pod IP: health SERVING + Generate.
    canary = subprocess.run(["ip", "netns", "exec", node_agent.node_netns, *probe_command()[:-1],
                             f"{ready.status.pod_ip}:50051"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PATH": os.pathsep.join([os.path.dirname(sys.executable),
                                                                       os.environ["PATH"]])})
    assert canary.returncode == 0, canary.stderr
    t1 = time.monotonic()
    core.delete_namespaced_pod("worker-0", k8s_namespace)
    wait_pod_gone(core, k8s_namespace, "worker-0", timeout=40)
    print(f"worker pod gone {time.monotonic() - t1:.1f} s after delete")
    # SIGTERM let it deregister (a SIGKILL would leave the record to its lease).
    assert _etcd_values(kube_cluster, f"/{k8s_namespace}/workers/") == []
