"""The test node agent (node_agent.py, the stand-in for kubelet + container
runtime) on the real control plane: its node stays Ready on its own
heartbeats, and pods bound to it run as real processes in network namespaces —
Ready by their probes, reachable on their pod IP, with Kubernetes' env
resolution, liveness restarts, graceful deletion, Failed on exit 1."""

from __future__ import annotations

import http.client
import itertools
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException

from cluster import wait_until
from controlplane import KubeCluster
from node_agent import AGENT_TAINT, GPU_TAINT, TOLERATION, NodeAgent, new_cluster_network
from node_agent_net import NAME_PREFIX, connect_in_netns, sweep_stale_namespaces

_cidrs = itertools.count(1)

# A small HTTP server standing for a workload: GET / answers its env and argv;
# /healthz fails once the file sick-<its pid> exists in $STATE_DIR; SIGTERM
# writes $STATE_DIR/terminated-<pid> before exiting.
SERVER = r"""
import http.server, json, os, signal, sys
state = os.environ.get("STATE_DIR", "/nonexistent")
def on_term(*_):
    with open(os.path.join(state, f"terminated-{os.getpid()}"), "w") as f:
        f.write("SIGTERM")
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
if os.path.isdir(state):
    with open(os.path.join(state, "pids"), "a") as f:
        f.write(f"{os.getpid()}\n")
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith("/resolve/"):
            import socket
            try:
                answer = socket.gethostbyname(self.path[len("/resolve/"):])
            except OSError as e:
                answer = f"error: {e}"
            body = json.dumps({"address": answer}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        sick = os.path.exists(os.path.join(state, f"sick-{os.getpid()}"))
        code = 500 if self.path == "/healthz" and sick else 200
        body = json.dumps({"env": dict(os.environ), "argv": sys.argv, "pid": os.getpid(),
                           "hosts": open("/etc/hosts").read()}).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Handler).serve_forever()
"""
PORT = 8080


@pytest.fixture
def node_agent(kube_cluster: KubeCluster, tmp_path: Path):
    agent = NodeAgent(kube_cluster.api_client(), f"agent-{secrets.token_hex(3)}", tmp_path / "agent", gpus=2,
                      pod_cidr=f"10.245.{next(_cidrs)}.0/24").start()
    try:
        kube_cluster.wait_node_ready(agent.node_name, True, timeout=30)
        yield agent
        assert not agent.errors, "\n".join(agent.errors)
    finally:
        agent.stop()
        kube_cluster.delete_node(agent.node_name)


def _server_pod(name: str, node: str, state_dir: Path, *, env: list | None = None, restart: str = "Always",
                liveness: bool = False, grace: int = 30) -> dict:
    probe = {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 1, "failureThreshold": 1}
    container = {"name": "main", "image": "splitserve:test", "command": ["python", "-c", SERVER],
                 "args": ["$(PORT)"], "ports": [{"name": "http", "containerPort": PORT}],
                 "env": [{"name": "PORT", "value": str(PORT)}, {"name": "STATE_DIR", "value": str(state_dir)},
                         *(env or [])],
                 "readinessProbe": {**probe, "failureThreshold": 3}}
    if liveness:
        # Liveness starts once the startup probe passed (kubelet's rule), so a slow boot is not a failure.
        container["startupProbe"] = {"httpGet": {"path": "/", "port": PORT}, "periodSeconds": 1,
                                     "failureThreshold": 30}
        container["livenessProbe"] = probe
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [container], "restartPolicy": restart, "nodeName": node,
                     "tolerations": [TOLERATION], "terminationGracePeriodSeconds": grace}}


def _wait_pod(core, ns: str, name: str, what: str, check, timeout: float = 30.0):
    return wait_until(lambda: (lambda p: p if check(p) else None)(core.read_namespaced_pod(name, ns)),
                      timeout=timeout, what=f"pod {ns}/{name} {what}")


def _ready(pod) -> bool:
    return pod.status.phase == "Running" and any(c.type == "Ready" and c.status == "True"
                                                 for c in pod.status.conditions or [])


def _get_in_netns(netns: str, ip: str, port: int, path: str = "/") -> tuple[int, dict]:
    conn = http.client.HTTPConnection(ip, port, timeout=5)
    conn.sock = connect_in_netns(netns, ip, port, 5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_node_is_ready_on_its_own_heartbeats(kube_cluster: KubeCluster, node_agent: NodeAgent):
    core = kube_cluster.core()
    node = core.read_node(node_agent.node_name)
    assert node.status.allocatable["nvidia.com/gpu"] == "2"
    assert node.spec.pod_cidr == node_agent.pod_cidr
    assert any(t.key == "splitserve.io/node-agent" for t in node.spec.taints)
    lease = kube_cluster.api_client()
    from kubernetes.client import CoordinationV1Api
    first = CoordinationV1Api(lease).read_namespaced_lease(node_agent.node_name, "kube-node-lease").spec.renew_time
    # Past the controller-manager's node monitor grace period (10 s): still Ready, lease renewed.
    time.sleep(12)
    kube_cluster.wait_node_ready(node_agent.node_name, True, timeout=1)
    later = CoordinationV1Api(lease).read_namespaced_lease(node_agent.node_name, "kube-node-lease").spec.renew_time
    assert later > first


def test_pod_runs_ready_and_answers_on_its_pod_ip(kube_cluster: KubeCluster, node_agent: NodeAgent,
                                                  k8s_namespace: str, tmp_path: Path):
    core = kube_cluster.core()
    core.create_namespaced_pod(k8s_namespace, _server_pod("web", node_agent.node_name, tmp_path))
    t0 = time.monotonic()
    pod = _wait_pod(core, k8s_namespace, "web", "Running and Ready", _ready)
    print(f"web Ready after {time.monotonic() - t0:.1f} s")
    status = pod.status.container_statuses[0]
    assert status.ready and status.restart_count == 0 and status.state.running is not None
    assert pod.status.pod_ip.startswith(node_agent.pod_cidr.rsplit(".", 2)[0])
    code, body = _get_in_netns(node_agent.node_netns, pod.status.pod_ip, PORT)
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
    core.create_namespaced_pod(k8s_namespace, _server_pod("envy", node_agent.node_name, tmp_path, env=env))
    pod = _wait_pod(core, k8s_namespace, "envy", "Running and Ready", _ready)
    _, body = _get_in_netns(node_agent.node_netns, pod.status.pod_ip, PORT)
    got = body["env"]
    assert (got["POD_NAME"], got["POD_NAMESPACE"], got["POD_IP"]) == ("envy", k8s_namespace, pod.status.pod_ip)
    assert (got["MODEL"], got["TOKEN"]) == ("tiny", "s3cret")
    assert got["ADDR"] == f"{pod.status.pod_ip}:{PORT} $(POD_IP) $(UNDEFINED)"
    # The pod's own /etc/hosts (through ip netns exec's /etc/netns bind mount), not the host's.
    assert f"{pod.status.pod_ip}\tenvy" in body["hosts"]


def test_pods_of_the_node_reach_each_other(kube_cluster: KubeCluster, node_agent: NodeAgent,
                                           k8s_namespace: str, tmp_path: Path):
    core = kube_cluster.core()
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        core.create_namespaced_pod(k8s_namespace, _server_pod(name, node_agent.node_name, tmp_path / name))
    a, b = (_wait_pod(core, k8s_namespace, n, "Running and Ready", _ready) for n in ("a", "b"))
    assert a.status.pod_ip != b.status.pod_ip
    # From inside pod a's namespace to pod b's IP, over the node bridge.
    code, body = _get_in_netns(node_agent.pod_netns(k8s_namespace, "a"), b.status.pod_ip, PORT)
    assert code == 200 and body["env"]["HOSTNAME"] == "b"


def test_failing_liveness_probe_restarts_the_container(kube_cluster: KubeCluster, node_agent: NodeAgent,
                                                       k8s_namespace: str, tmp_path: Path):
    core = kube_cluster.core()
    core.create_namespaced_pod(k8s_namespace, _server_pod("sick", node_agent.node_name, tmp_path, liveness=True))
    _wait_pod(core, k8s_namespace, "sick", "Running and Ready", _ready)
    first_pid = int((tmp_path / "pids").read_text().split()[0])
    (tmp_path / f"sick-{first_pid}").write_text("")
    pod = _wait_pod(core, k8s_namespace, "sick", "restarted and Ready again",
                    lambda p: p.status.container_statuses[0].restart_count >= 1 and _ready(p))
    status = pod.status.container_statuses[0]
    assert status.restart_count == 1
    assert status.last_state.terminated is not None
    assert (tmp_path / f"terminated-{first_pid}").read_text() == "SIGTERM"   # killed gracefully
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2 and pids[1] != first_pid


def test_deleting_a_pod_sends_sigterm_then_removes_it(kube_cluster: KubeCluster, node_agent: NodeAgent,
                                                      k8s_namespace: str, tmp_path: Path):
    core = kube_cluster.core()
    core.create_namespaced_pod(k8s_namespace, _server_pod("bye", node_agent.node_name, tmp_path, grace=20))
    _wait_pod(core, k8s_namespace, "bye", "Running and Ready", _ready)
    pid = int((tmp_path / "pids").read_text().split()[0])
    t0 = time.monotonic()
    core.delete_namespaced_pod("bye", k8s_namespace)

    def gone() -> bool:
        try:
            core.read_namespaced_pod("bye", k8s_namespace)
            return False
        except ApiException as e:
            return e.status == 404

    wait_until(gone, timeout=15, what="pod bye to disappear")
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
    done = _wait_pod(core, k8s_namespace, "oops", "Failed", lambda p: p.status.phase == "Failed")
    status = done.status.container_statuses[0]
    assert status.state.terminated.exit_code == 1 and status.restart_count == 0 and not status.ready


def test_headless_service_names_resolve_in_pods(kube_cluster: KubeCluster, node_agent: NodeAgent,
                                                k8s_namespace: str, tmp_path: Path):
    core = kube_cluster.core()
    core.create_namespaced_service(k8s_namespace, {
        "metadata": {"name": "grp"},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"app": "grp"},
                 "ports": [{"name": "http", "port": PORT}]}})
    for name in ("rank-0", "rank-1"):
        (tmp_path / name).mkdir()
        pod = _server_pod(name, node_agent.node_name, tmp_path / name)
        pod["metadata"]["labels"] = {"app": "grp"}
        pod["spec"].update({"hostname": name, "subdomain": "grp"})
        core.create_namespaced_pod(k8s_namespace, pod)
    leader, follower = (_wait_pod(core, k8s_namespace, n, "Running and Ready", _ready) for n in ("rank-0", "rank-1"))
    fqdn = f"rank-0.grp.{k8s_namespace}.svc.cluster.local"     # the operator's leader address form

    def resolved() -> str | None:
        _, body = _get_in_netns(node_agent.node_netns, follower.status.pod_ip, PORT, f"/resolve/{fqdn}")
        return body["address"] if body["address"] == leader.status.pod_ip else None

    wait_until(resolved, timeout=10, what=f"{fqdn} to resolve to {leader.status.pod_ip} inside rank-1")
    _, short = _get_in_netns(node_agent.node_netns, follower.status.pod_ip, PORT, "/resolve/rank-0.grp")
    assert short["address"] == leader.status.pod_ip
    _, none = _get_in_netns(node_agent.node_netns, follower.status.pod_ip, PORT, "/resolve/nope.grp")
    assert none["address"].startswith("error")         # no DNS behind it: fails, and at once


def test_pods_on_two_linked_nodes_reach_and_name_each_other(kube_cluster: KubeCluster, k8s_namespace: str,
                                                            tmp_path: Path):
    core = kube_cluster.core()
    network = new_cluster_network()
    agents: list[NodeAgent] = []
    try:
        for i in range(2):
            agents.append(NodeAgent(kube_cluster.api_client(), f"agent-{secrets.token_hex(3)}",
                                    tmp_path / f"agent{i}", gpus=1, pod_cidr=f"10.245.{next(_cidrs)}.0/24",
                                    cluster=network).start())
        core.create_namespaced_service(k8s_namespace, {
            "metadata": {"name": "grp"},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"app": "grp"}}})
        for i, agent in enumerate(agents):
            (tmp_path / f"r{i}").mkdir()
            pod = _server_pod(f"r{i}", agent.node_name, tmp_path / f"r{i}")
            pod["metadata"]["labels"] = {"app": "grp"}
            pod["spec"].update({"hostname": f"r{i}", "subdomain": "grp"})
            core.create_namespaced_pod(k8s_namespace, pod)
        r0, r1 = (_wait_pod(core, k8s_namespace, f"r{i}", "Running and Ready", _ready) for i in range(2))
        assert r0.spec.node_name != r1.spec.node_name
        # Pod to pod across nodes: r0's namespace -> node 0 -> cluster bridge -> node 1 -> r1.
        code, body = _get_in_netns(agents[0].pod_netns(k8s_namespace, "r0"), r1.status.pod_ip, PORT)
        assert code == 200 and body["env"]["HOSTNAME"] == "r1"
        fqdn = f"r1.grp.{k8s_namespace}.svc.cluster.local"

        def resolved() -> bool:
            _, answer = _get_in_netns(agents[0].node_netns, r0.status.pod_ip, PORT, f"/resolve/{fqdn}")
            return answer["address"] == r1.status.pod_ip

        wait_until(resolved, timeout=10, what=f"{fqdn} to resolve inside r0 (on the other node)")
    finally:
        for agent in agents:
            agent.stop()
            kube_cluster.delete_node(agent.node_name)
        network.destroy()
    assert not any(errors for errors in (a.errors for a in agents)), [a.errors for a in agents]


GRPC_SERVER = r"""
import sys, time
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
server = grpc.server(futures.ThreadPoolExecutor(2))
servicer = health.HealthServicer()
servicer.set("", health_pb2.HealthCheckResponse.SERVING)
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
server.add_insecure_port(f"0.0.0.0:{sys.argv[1]}")
server.start()
open(sys.argv[2], "w").write("up")
server.wait_for_termination()
"""


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
    ready = _wait_pod(core, k8s_namespace, "probed", "Running and Ready", _ready, timeout=45)
    status = ready.status.container_statuses[0]
    assert status.started and status.ready and status.restart_count == 0


def test_container_without_command_runs_the_splitserve_entrypoint(kube_cluster: KubeCluster,
                                                                  node_agent: NodeAgent, k8s_namespace: str):
    core = kube_cluster.core()
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cli"},
           "spec": {"restartPolicy": "Never", "nodeName": node_agent.node_name, "tolerations": [TOLERATION],
                    "containers": [{"name": "main", "image": "splitserve:test", "args": ["--help"]}]}}
    core.create_namespaced_pod(k8s_namespace, pod)
    done = _wait_pod(core, k8s_namespace, "cli", "Succeeded", lambda p: p.status.phase == "Succeeded", timeout=60)
    assert done.status.container_statuses[0].state.terminated.exit_code == 0
    log = node_agent.container_log(k8s_namespace, "cli")
    assert "usage: splitserve" in log, log


def test_gpu_tainted_node_is_one_the_operator_would_bind_to(kube_cluster: KubeCluster, tmp_path: Path):
    from splitserve.operator.scheduler import node_schedulable

    agent = NodeAgent(kube_cluster.api_client(), f"agent-{secrets.token_hex(3)}", tmp_path / "agent", gpus=4,
                      pod_cidr=f"10.245.{next(_cidrs)}.0/24", taint=GPU_TAINT).start()
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
                      pod_cidr=f"10.245.{next(_cidrs)}.0/24").start()
    try:
        core.create_namespaced_pod(k8s_namespace, _server_pod("w", agent.node_name, tmp_path))
        _wait_pod(core, k8s_namespace, "w", "Running and Ready", _ready)
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


def test_a_real_splitserve_worker_pod_goes_ready(kube_cluster: KubeCluster, node_agent: NodeAgent,
                                                 k8s_namespace: str, llama_dir: Path):
    """A worker shaped like the operator's rank-0 pod (entrypoint splitserve, POD_IP/POD_NAME
    from fieldRefs, gRPC startup probe, the operator's exec canary as readiness), without etcd."""
    from splitserve.operator.builders import probe_command

    core = kube_cluster.core()
    container = {
        "name": "worker", "image": "splitserve:test", "command": ["splitserve"],
        "args": ["worker", "--model", str(llama_dir), "--host", "0.0.0.0", "--advertise-host", "$(POD_IP)",
                 "--port", "50051", "--threads", "1", "--kv-cache-gib", "0.05", "--worker-id", "$(POD_NAME)"],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "PYTHONUNBUFFERED", "value": "1"}],
        "startupProbe": {"grpc": {"port": 50051}, "periodSeconds": 1, "failureThreshold": 150},
        "readinessProbe": {"exec": {"command": probe_command()}, "periodSeconds": 2, "timeoutSeconds": 20}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "worker-0"},
           "spec": {"containers": [container], "nodeName": node_agent.node_name, "tolerations": [TOLERATION],
                    "terminationGracePeriodSeconds": 30}}
    t0 = time.monotonic()
    core.create_namespaced_pod(k8s_namespace, pod)
    try:
        ready = _wait_pod(core, k8s_namespace, "worker-0", "Running and Ready", _ready, timeout=150)
    except TimeoutError:
        raise AssertionError(node_agent.container_log(k8s_namespace, "worker-0")[-4000:]) from None
    print(f"worker pod Ready after {time.monotonic() - t0:.1f} s")
    assert ready.status.container_statuses[0].restart_count == 0
    assert "worker worker-0 ready" in node_agent.container_log(k8s_namespace, "worker-0")   # $(POD_NAME)
    # The operator's canary from another namespace (the node's), to the pod IP: health SERVING + Generate.
    canary = subprocess.run(["ip", "netns", "exec", node_agent.node_netns, *probe_command()[:-1],
                             f"{ready.status.pod_ip}:50051"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PATH": os.pathsep.join([os.path.dirname(sys.executable),
                                                                       os.environ["PATH"]])})
    assert canary.returncode == 0, canary.stderr
    t1 = time.monotonic()
    core.delete_namespaced_pod("worker-0", k8s_namespace)

    def gone() -> bool:
        try:
            core.read_namespaced_pod("worker-0", k8s_namespace)
            return False
        except ApiException as e:
            return e.status == 404

    wait_until(gone, timeout=40, what="worker pod to disappear")
    print(f"worker pod gone {time.monotonic() - t1:.1f} s after delete")
