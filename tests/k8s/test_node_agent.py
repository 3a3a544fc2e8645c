"""The test node agent (node_agent.py, the stand-in for kubelet + container
runtime) on the real control plane: its node stays Ready on its own
heartbeats, and pods bound to it run as real processes — Ready by their probes
(httpGet, exec, tcpSocket, grpc), with Kubernetes' env resolution, liveness
restarts, SIGTERM on deletion, Failed on exit 1, the `splitserve` entrypoint.
Networking and names: test_node_agent_network.py."""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import subprocess
import time
from pathlib import Path

from kubernetes.client import CoordinationV1Api

from cluster import wait_until
from controlplane import KubeCluster
from node_agent import AGENT_TAINT, GPU_TAINT, TOLERATION, NodeAgent
from node_agent_net import NAME_PREFIX, ClusterNetwork, NodeNetwork, bridge_mac, sweep_stale_namespaces
from node_agent_workloads import (GRPC_SERVER, PORT, get_in_netns, is_ready, next_pod_cidr, server_pod,
                                  wait_pod, wait_pod_gone)


def test_node_is_ready_on_its_own_heartbeats(kube_cluster: KubeCluster, node_agent: NodeAgent):
    core = kube_cluster.core()
    node = core.read_node(node_agent.node_name)
    assert node.status.allocatable["nvidia.com/gpu"] == "2"
    assert node.spec.pod_cidr == node_agent.pod_cidr
    assert any(t.key == "splitserve.io/node-agent" for t in node.spec.taints)
    leases = CoordinationV1Api(kube_cluster.api_client())
    first = leases.read_namespaced_lease(node_agent.node_name, "kube-node-lease").spec.renew_time
    # Past the controller-manager's node monitor grace period (10 s): still Ready, lease renewed.
    time.sleep(12)
    kube_cluster.wait_node_ready(node_agent.node_name, True, timeout=1)
    later = leases.read_namespaced_lease(node_agent.node_name, "kube-node-lease").spec.renew_time
    assert later > first


def test_pod_runs_ready_and_answers_on_its_pod_ip(kube_cluster: KubeCluster, node_agent: NodeAgent,
                                                  k8s_namespace: str, tmp_path: Path):
    core = kube_cluster.core()
    core.create_namespaced_pod(k8s_namespace, server_pod("web", node_agent.node_name, tmp_path))
    t0 = time.monotonic()
    pod = wait_pod(core, k8s_namespace, "web", "Running and Ready", is_ready)
    print(f"web Ready after {time.monotonic() - t0:.1f} s")
    status = pod.status.container_statuses[0]
    assert status.ready and status.restart_count == 0 and status.state.running is not None
    assert pod.status.pod_ip.startswith(node_agent.pod_cidr.rsplit(".", 2)[0])
    code, body = get_in_netns(node_agent.node_netns, pod.status.pod_ip, PORT)
    assert code == 200
    assert body["argv"][1:] == [str(PORT)]          # $(PORT) expanded in args
    assert body["env"]["HOSTNAME"] == "web"
    # The process runs inside the pod's namespace: its address is not on the host.
    host_addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    assert f" {pod.status.pod_ip}/" not in host_addrs


def test_env_from_field_refs_config_maps_and_secrets(kube_cluster: KubeCluster, node_agent: NodeAgent,
                                                     k8s_namespace: str, tmp_path: Path):
    core = kube_cluster.core()
    core.create_namespaced_config_map(k8s_namespace, {"metadata": {"name": "cfg"}, "data": {"model": "tiny"}})
    core.create_namespaced_secret(k8s_namespace, {"metadata": {"name": "sec"}, "stringData": {"token": "s3cret"}})
    env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
           {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "MODEL", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "model"}}},
           {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "token"}}},
           {"name": "ADDR", "value": "$(POD_IP):$(PORT) $$(POD_IP) $(UNDEFINED)"}]
    core.create_namespaced_pod(k8s_namespace, server_pod("envy", node_agent.node_name, tmp_path, env=env))
    pod = wait_pod(core, k8s_namespace, "envy", "Running and Ready", is_ready)
    _, body = get_in_netns(node_agent.node_netns, pod.status.pod_ip, PORT)
    got = body["env"]
    assert (got["POD_NAME"], got["POD_NAMESPACE"], got["POD_IP"]) == ("envy", k8s_namespace, pod.status.pod_ip)
    assert (got["MODEL"], got["TOKEN"]) == ("tiny", "s3cret")
    assert got["ADDR"] == f"{pod.status.pod_ip}:{PORT} $(POD_IP) $(UNDEFINED)"
    # The pod's own /etc/hosts (through ip netns exec's /etc/netns bind mount), not the host's.
    assert f"{pod.status.pod_ip}\tenvy" in body["hosts"]


def test_failing_liveness_probe_restarts_the_container(kube_cluster: KubeCluster, node_agent: NodeAgent,
                                                       k8s_namespace: str, tmp_path: Path):
    core = kube_cluster.core()
    core.create_namespaced_pod(k8s_namespace, server_pod("sick", node_agent.node_name, tmp_path, liveness=True))
    wait_pod(core, k8s_namespace, "sick", "Running and Ready", is_ready)
    first_pid = int((tmp_path / "pids").read_text().split()[0])
    (tmp_path / f"sick-{first_pid}").write_text("")
    pod = wait_pod(core, k8s_namespace, "sick", "restarted and Ready again",
                    lambda p: p.status.container_statuses[0].restart_count >= 1 and is_ready(p))
    status = pod.status.container_statuses[0]
    assert status.restart_count == 1
    assert status.last_state.terminated is not None
    assert (tmp_path / f"terminated-{first_pid}").read_text() == "SIGTERM"   # killed gracefully
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2 and pids[1] != first_pid


def test_deleting_a_pod_sends_sigterm_then_removes_it(kube_cluster: KubeCluster, node_agent: NodeAgent,
                                                      k8s_namespace: str, tmp_path: Path):
    core = kube_cluster.core()
    core.create_namespaced_pod(k8s_namespace, server_pod("bye", node_agent.node_name, tmp_path, grace=20))
    wait_pod(core, k8s_namespace, "bye", "Running and Ready", is_ready)
    pid = int((tmp_path / "pids").read_text().split()[0])
    t0 = time.monotonic()
    core.delete_namespaced_pod("bye", k8s_namespace)

    wait_pod_gone(core, k8s_namespace, "bye", timeout=15)
    assert time.monotonic() - t0 < 15            # it exited on SIGTERM, well before the 20 s grace
    assert (tmp_path / f"terminated-{pid}").read_text() == "SIGTERM"
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), timeout=5, what=f"process {pid} to exit")


def test_restart_policy_never_exit_1_fails_the_pod(kube_cluster: KubeCluster, node_agent: NodeAgent,
                                                   k8s_namespace: str):
    core = kube_cluster.core()
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "oops"},
           "spec": {"restartPolicy": "Never", "nodeName": node_agent.node_name, "tolerations": [TOLERATION],
                    "containers": [{"name": "main", "image": "splitserve:test",
                                    "command": ["python", "-c", "import sys; sys.exit(1)"]}]}}
    core.create_namespaced_pod(k8s_namespace, pod)
    done = wait_pod(core, k8s_namespace, "oops", "Failed", lambda p: p.status.phase == "Failed")
    status = done.status.container_statuses[0]
    assert status.state.terminated.exit_code == 1 and status.restart_count == 0 and not status.ready


def test_exec_tcp_and_grpc_probes(kube_cluster: KubeCluster, node_agent: NodeAgent, k8s_namespace: str,
                                  tmp_path: Path):
    core = kube_cluster.core()
    up = tmp_path / "up"
    container = {"name": "grpc", "image": "splitserve:test", "command": ["python", "-c", GRPC_SERVER],
                 "args": ["9000", str(up)],
                 "startupProbe": {"exec": {"command": ["test", "-f", str(up)]}, "periodSeconds": 1,
                                  "failureThreshold": 30},
                 "livenessProbe": {"tcpSocket": {"port": 9000}, "periodSeconds": 1},
                 "readinessProbe": {"grpc": {"port": 9000}, "periodSeconds": 1}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probed"},
           "spec": {"containers": [container], "nodeName": node_agent.node_name, "tolerations": [TOLERATION]}}
    core.create_namespaced_pod(k8s_namespace, pod)
    ready = wait_pod(core, k8s_namespace, "probed", "Running and Ready", is_ready, timeout=45)
    status = ready.status.container_statuses[0]
    assert status.started and status.ready and status.restart_count == 0


def test_container_without_command_runs_the_splitserve_entrypoint(kube_cluster: KubeCluster,
                                                                  node_agent: NodeAgent, k8s_namespace: str):
    core = kube_cluster.core()
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cli"},
           "spec": {"restartPolicy": "Never", "nodeName": node_agent.node_name, "tolerations": [TOLERATION],
                    "containers": [{"name": "main", "image": "splitserve:test", "args": ["--help"]}]}}
    core.create_namespaced_pod(k8s_namespace, pod)
    done = wait_pod(core, k8s_namespace, "cli", "Succeeded", lambda p: p.status.phase == "Succeeded", timeout=60)
    assert done.status.container_statuses[0].state.terminated.exit_code == 0
    log = node_agent.container_log(k8s_namespace, "cli")
    assert "usage: splitserve" in log, log


def test_gpu_tainted_node_is_one_the_operator_would_bind_to(kube_cluster: KubeCluster, tmp_path: Path):
    from splitserve.operator.scheduler import node_schedulable

    agent = NodeAgent(kube_cluster.api_client(), f"agent-{secrets.token_hex(3)}", tmp_path / "agent", gpus=4,
                      pod_cidr=next_pod_cidr(), taint=GPU_TAINT).start()
    try:
        node = kube_cluster.api_client().sanitize_for_serialization(kube_cluster.wait_node_ready(agent.node_name, True))
        assert node_schedulable(node)
    finally:
        agent.stop()
        kube_cluster.delete_node(agent.node_name)
    # The default taint keeps the operator (and pods that do not tolerate it) away.
    assert not node_schedulable({**node, "spec": {**node["spec"], "taints": [AGENT_TAINT]}})


def test_stop_removes_namespaces_and_sweep_removes_a_killed_agents(kube_cluster: KubeCluster, tmp_path: Path,
                                                                  k8s_namespace: str):
    core = kube_cluster.core()
    agent = NodeAgent(kube_cluster.api_client(), f"agent-{secrets.token_hex(3)}", tmp_path / "agent", gpus=1,
                      pod_cidr=next_pod_cidr()).start()
    try:
        core.create_namespaced_pod(k8s_namespace, server_pod("w", agent.node_name, tmp_path))
        wait_pod(core, k8s_namespace, "w", "Running and Ready", is_ready)
        pid = int((tmp_path / "pids").read_text().split()[0])
        prefix = agent.node_netns.removesuffix("-node")
    finally:
        agent.stop()
        kube_cluster.delete_node(agent.node_name)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert prefix not in left
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    # A namespace whose agent pid is dead (a killed run) is swept by the next start.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{NAME_PREFIX}-{dead.pid}-1-node"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in sweep_stale_namespaces()
    assert not os.path.exists(f"/run/netns/{stale}")


_IN_CLUSTER = """
import json, os, pathlib, socket
from kubernetes import client, config
config.load_incluster_config()                     # KUBERNETES_SERVICE_HOST/PORT + the projected token
me = client.CoreV1Api().read_namespaced_pod(os.environ["HOSTNAME"], pathlib.Path(
    "/var/run/secrets/kubernetes.io/serviceaccount/namespace").read_text())
try:
    client.CoreV1Api().list_node()
    nodes = "allowed"
except client.exceptions.ApiException as e:
    nodes = e.status
print(json.dumps({"uid": me.metadata.uid, "nodes": nodes, "hostname": socket.gethostname(),
                  "secret": pathlib.Path("/etc/agent-test/secret/pass").read_text(),
                  "config": pathlib.Path("/etc/agent-test/config/renamed.txt").read_text(),
                  "scratch": sorted(os.listdir("/etc/agent-test/scratch"))}), flush=True)
pathlib.Path("/etc/agent-test/scratch/mine").write_text("x")
"""


def test_volumes_and_the_service_account_reach_the_api_in_cluster(kube_cluster: KubeCluster, node_agent: NodeAgent,
                                                                  k8s_namespace: str):
    """Secret, configMap (items) and emptyDir volumes at their mount paths, and the projected
    ServiceAccount token + KUBERNETES_SERVICE_HOST: in-cluster config logs in as the pod's
    ServiceAccount, whose RBAC (a Role to read pods, nothing cluster-wide) refuses listing nodes."""
    from kubernetes.client import RbacAuthorizationV1Api

    core = kube_cluster.core()
    kube_cluster.wait_for_service_account(k8s_namespace)
    rbac = RbacAuthorizationV1Api(kube_cluster.api_client())
    rbac.create_namespaced_role(k8s_namespace, {"metadata": {"name": "read-pods"}, "rules": [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]})
    rbac.create_namespaced_role_binding(k8s_namespace, {
        "metadata": {"name": "read-pods"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read-pods"},
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": k8s_namespace}]})
    core.create_namespaced_secret(k8s_namespace, {"metadata": {"name": "s"}, "stringData": {"pass": "hunter2"}})
    core.create_namespaced_config_map(k8s_namespace, {"metadata": {"name": "c"}, "data": {"a": "alpha", "b": "beta"}})
    container = {"name": "main", "image": "splitserve:test", "command": ["python", "-c", _IN_CLUSTER],
                 "volumeMounts": [{"name": "sec", "mountPath": "/etc/agent-test/secret", "readOnly": True},
                                  {"name": "cfg", "mountPath": "/etc/agent-test/config"},
                                  {"name": "scratch", "mountPath": "/etc/agent-test/scratch"}]}
    core.create_namespaced_pod(k8s_namespace, {"metadata": {"name": "incluster"}, "spec": {
        "containers": [container], "restartPolicy": "Never", "nodeName": node_agent.node_name,
        "tolerations": [TOLERATION],
        "volumes": [{"name": "sec", "secret": {"secretName": "s"}},
                    {"name": "cfg", "configMap": {"name": "c", "items": [{"key": "b", "path": "renamed.txt"}]}},
                    {"name": "scratch", "emptyDir": {}}]}})
    pod = wait_pod(core, k8s_namespace, "incluster", "Succeeded", lambda p: p.status.phase in ("Succeeded", "Failed"),
                   timeout=60)
    log = node_agent.container_log(k8s_namespace, "incluster")
    assert pod.status.phase == "Succeeded", log
    seen = json.loads(log.strip().splitlines()[-1])
    assert seen == {"uid": pod.metadata.uid, "nodes": 403, "hostname": "incluster", "secret": "hunter2",
                    "config": "beta", "scratch": []}
    # The mounts were the container's own: on the host only the (empty) mount points remain.
    assert [p for p in Path("/etc/agent-test").rglob("*") if not p.is_dir()] == []


def test_an_empty_dir_over_the_python_environment_leaves_it_in_place(kube_cluster: KubeCluster,
                                                                      node_agent: NodeAgent, k8s_namespace: str):
    """A scratch volume mounted over the folder that holds the tests' Python environment (as an
    emptyDir at /tmp does when the venv lives under /tmp): the container still runs that
    interpreter and imports splitserve from it, and sees the volume's own (empty) content beside."""
    import sys

    hiding = os.path.dirname(os.path.realpath(sys.prefix))       # e.g. /tmp for /tmp/venv
    probe = ("import json, os, sys, splitserve; print(json.dumps({'prefix': sys.prefix, "
             "'splitserve': splitserve.__file__, 'beside': sorted(os.listdir(%r))}))" % hiding)
    container = {"name": "main", "image": "splitserve:test", "command": [sys.executable, "-c", probe],
                 "volumeMounts": [{"name": "scratch", "mountPath": hiding}]}
    core = kube_cluster.core()
    core.create_namespaced_pod(k8s_namespace, {"metadata": {"name": "hidden-env"}, "spec": {
        "containers": [container], "restartPolicy": "Never", "nodeName": node_agent.node_name,
        "tolerations": [TOLERATION], "volumes": [{"name": "scratch", "emptyDir": {}}]}})
    pod = wait_pod(core, k8s_namespace, "hidden-env", "Succeeded", lambda p: p.status.phase in ("Succeeded", "Failed"),
                   timeout=60)
    log = node_agent.container_log(k8s_namespace, "hidden-env")
    assert pod.status.phase == "Succeeded", log
    seen = json.loads(log.strip().splitlines()[-1])
    assert seen["prefix"] == sys.prefix
    assert os.path.realpath(seen["splitserve"]) == os.path.realpath(__import__("splitserve").__file__)
    # Only what the environment needs shows through the empty volume.
    assert seen["beside"] == [os.path.basename(os.path.realpath(sys.prefix))]


def test_the_pods_gateway_keeps_its_mac_as_pods_join():
    """Linux gives a bridge without an address of its own the lowest MAC of its ports: a pod
    joining with a lower one moved the gateway's MAC under the pods already there, and their
    connections stalled for 30-40 s (the e2e gateway test's picker lost its watch events). The
    node's bridge and the cluster's keep the MAC the agent set."""
    network = NodeNetwork(f"{NAME_PREFIX}-{os.getpid()}-mac", ipaddress.ip_network("10.249.7.0/24"))
    cluster = ClusterNetwork(f"{NAME_PREFIX}-{os.getpid()}-macc")
    try:
        network.create()
        cluster.create()
        cluster.attach(network)
        macs = [_bridge_mac(network.netns)]
        for i in range(6):
            network.add_pod(f"uid-{i}", lambda ip: f"{ip} pod\n")
            macs.append(_bridge_mac(network.netns))
        assert set(macs) == {bridge_mac(network.netns)}, macs
        assert _bridge_mac(cluster.netns) == bridge_mac(cluster.netns)
        assert bridge_mac(network.netns) != bridge_mac(cluster.netns)
    finally:
        network.destroy()
        cluster.destroy()


def _bridge_mac(netns: str) -> str:
    shown = subprocess.run(["ip", "-n", netns, "-j", "link", "show", "br0"], capture_output=True, text=True,
                           check=True).stdout
    return json.loads(shown)[0]["address"]
