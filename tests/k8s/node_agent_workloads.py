"""Workloads for the test node agent's tests: small servers, pod manifests, bounded waits.

Test infrastructure (see node_agent.py). SERVER is a tiny HTTP server that
stands for a workload and reports what a test needs to see from inside the pod
(its env, argv, /etc/hosts, name resolution, a SIGTERM marker); GRPC_SERVER
serves grpc.health.v1 only.
"""

from __future__ import annotations

import http.client
import itertools
import json
from pathlib import Path

from kubernetes.client.exceptions import ApiException

from cluster import wait_until
from node_agent import TOLERATION
from node_agent_net import connect_in_netns

_cidrs = itertools.count(1)


def next_pod_cidr() -> str:
    """A pod CIDR no other agent of this test session has (nodes of one cluster must not share one)."""
    return f"10.245.{next(_cidrs)}.0/24"


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


def server_pod(name: str, node: str, state_dir: Path, *, env: list | None = None, restart: str = "Always",
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


def wait_pod(core, ns: str, name: str, what: str, check, timeout: float = 30.0):
    return wait_until(lambda: (lambda p: p if check(p) else None)(core.read_namespaced_pod(name, ns)),
                      timeout=timeout, what=f"pod {ns}/{name} {what}")


def is_ready(pod) -> bool:
    return pod.status.phase == "Running" and any(c.type == "Ready" and c.status == "True"
                                                 for c in pod.status.conditions or [])


def get_in_netns(netns: str, ip: str, port: int, path: str = "/") -> tuple[int, dict]:
    conn = http.client.HTTPConnection(ip, port, timeout=5)
    conn.sock = connect_in_netns(netns, ip, port, 5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()




def wait_pod_gone(core, ns: str, name: str, timeout: float) -> None:
    def gone() -> bool:
        try:
            core.read_namespaced_pod(name, ns)
            return False
        except ApiException as e:
            return e.status == 404

    wait_until(gone, timeout=timeout, what=f"pod {ns}/{name} to disappear")
