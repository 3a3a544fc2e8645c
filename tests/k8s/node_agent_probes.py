"""Probes of the test node agent, run inside the pod's network namespace.

Test infrastructure, part of the stand-in for kubelet + container runtime
(node_agent.py). Kubelet probes a container from the node; here every probe
runs inside the pod's own namespace, against the pod's IP (or the probe's
`host`):

- exec: the command runs through `ip netns exec` with the container's env; exit 0 passes;
- httpGet: a request on a socket opened inside the namespace; 200-399 passes;
- tcpSocket: a connect inside the namespace;
- grpc: grpc.health.v1 Check from a short python run through `ip netns exec`
  (grpc's own I/O threads would not inherit a setns'd thread's namespace); SERVING passes.

`ProbeState` counts consecutive results against the thresholds, as kubelet does.
"""

from __future__ import annotations

import http.client
import ssl
import subprocess
import sys
from dataclasses import dataclass

from node_agent_net import connect_in_netns
from node_agent_spec import Probe, resolve_port

_GRPC_CHECK = """
import sys, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
ch = grpc.insecure_channel(sys.argv[1])
r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=sys.argv[2]), timeout=float(sys.argv[3]))
sys.exit(0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1)
"""


def _http_get(netns: str, host: str, port: int, handler: dict, timeout: float) -> bool:
    sock = connect_in_netns(netns, host, port, timeout)
    if handler.get("scheme", "HTTP").upper() == "HTTPS":
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE      # kubelet does not verify probe certificates either
        sock = ctx.wrap_socket(sock, server_hostname=host)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    conn.sock = sock
    try:
        headers = {h["name"]: h["value"] for h in handler.get("httpHeaders") or []}
        headers.setdefault("User-Agent", "kube-probe/splitserve-node-agent")
        conn.request("GET", handler.get("path", "/"), headers=headers)
        return 200 <= conn.getresponse().status < 400
    finally:
        conn.close()


def run_probe(probe: Probe, netns: str, pod_ip: str, container: dict, env: dict[str, str]) -> bool:
    """One probe attempt: True when it passes. Never raises for a failing target."""
    h = probe.handler
    try:
        if probe.kind == "exec":
            proc = subprocess.run(["ip", "netns", "exec", netns, *h["command"]], env=env, timeout=probe.timeout,
                                  stdin=subprocess.DEVNULL, capture_output=True)
            return proc.returncode == 0
        port = resolve_port(h["port"], container)
        host = h.get("host") or pod_ip
        if probe.kind == "httpGet":
            return _http_get(netns, host, port, h, probe.timeout)
        if probe.kind == "tcpSocket":
            connect_in_netns(netns, host, port, probe.timeout).close()
            return True
        proc = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", _GRPC_CHECK,
                               f"{host}:{port}", h.get("service", ""), str(probe.timeout)],
                              timeout=probe.timeout + 10, stdin=subprocess.DEVNULL, capture_output=True)
        return proc.returncode == 0
    except (OSError, subprocess.TimeoutExpired, http.client.HTTPException):
        return False


@dataclass(slots=True)
class ProbeState:
    """Consecutive results of one probe of one container run."""

    probe: Probe
    started_at: float
    next_due: float = 0.0
    successes: int = 0
    failures: int = 0
    passed: bool = False        # the thresholded verdict (readiness: ready; startup: started)
    failed: bool = False        # failureThreshold consecutive failures reached

    @classmethod
    def begin(cls, probe: Probe | None, now: float) -> ProbeState | None:
        if probe is None:
            return None
        return cls(probe, started_at=now, next_due=now + probe.initial_delay)

    def due(self, now: float) -> bool:
        return now >= self.next_due

    def record(self, ok: bool, now: float) -> None:
        self.next_due = now + self.probe.period
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= self.probe.success_threshold:
                self.passed, self.failed = True, False
        else:
            self.failures, self.successes = self.failures + 1, 0
            if self.failures >= self.probe.failure_threshold:
                self.passed, self.failed = False, True

