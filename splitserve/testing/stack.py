"""One worker and any number of frontends as real processes, for the security and fuzz tests.

Each process listens on free ports of 127.0.0.1 and runs with one torch thread;
its combined output is collected (tests assert on it: no API key in any log
line, no traceback). `Stack.close()` stops everything it started (SIGTERM, then
SIGKILL after a grace period) and returns the exit codes, so a test can check
that nothing crashed.
"""

from __future__ import annotations

import re
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from splitserve.net import free_port
from splitserve.testing.cluster import Proc

READY_TIMEOUT_S = 120.0


@dataclass
class Frontend:
    proc: Proc
    port: int
    grpc_port: int
    scheme: str = "http"
    ca: Path | None = None          # verifies an HTTPS frontend's certificate

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def openai_url(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def ssl_context(self) -> ssl.SSLContext | None:
        return ssl.create_default_context(cafile=str(self.ca)) if self.scheme == "https" else None

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=5, context=self.ssl_context()) as reply:
                return reply.status, reply.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except (urllib.error.URLError, OSError):
            return 0, b""

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        _, text = self.get("/metrics")
        total = 0.0
        for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", text.decode(), re.MULTILINE):
            have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total += float(m.group(2))
        return total

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.get("/ready")[0] == 200:
                return
            if not self.proc.alive():
                break
            time.sleep(0.1)
        raise AssertionError("frontend not ready:\n" + self.proc.output[-4000:])


class Stack:
    """A worker (`start_worker`) and frontends in front of it (`start_frontend`)."""

    def __init__(self, model: str | Path, log_level: str = "info"):
        self.model = str(model)
        self.log_level = log_level
        self.procs: list[Proc] = []
        self.worker: Proc | None = None
        self.worker_address = ""

    def start_worker(self, *extra: str, env: dict | None = None, role: str = "both") -> str:
        port = free_port()
        self.worker = Proc.start(["splitserve", "--log-level", self.log_level, "worker", "--role", role,
                                  "--model", self.model, "--port", str(port), "--threads", "1",
                                  "--kv-cache-gib", "0.05", "--worker-id", "worker-0", *extra], env)
        self.procs.append(self.worker)
        self.worker_address = f"127.0.0.1:{port}"
        self.worker.wait_for_line(r"worker worker-0 ready")
        return self.worker_address

    def start_frontend(self, *extra: str, env: dict | None = None, https_ca: Path | None = None,
                       wait: bool = True) -> Frontend:
        port, grpc_port = free_port(), free_port()
        proc = Proc.start(["splitserve", "--log-level", self.log_level, "frontend", "--model", self.model,
                           "--port", str(port), "--grpc-port", str(grpc_port),
                           "--worker", f"both={self.worker_address}", *extra], env)
        self.procs.append(proc)
        front = Frontend(proc, port, grpc_port, "https" if https_ca else "http", https_ca)
        if wait:
            front.wait_ready()
        return front

    def outputs(self) -> str:
        return "\n".join(p.output for p in self.procs)

    def assert_clean_exit(self, codes: list[int], num_procs: int) -> None:
        """After close(): every one of `num_procs` processes exited 0, none printed a traceback."""
        assert codes == [0] * num_procs, self.outputs()[-3000:]
        assert "Traceback" not in self.outputs(), self.outputs()[-6000:]

    def close(self) -> list[int]:
        """Stop everything; the exit codes in start order (0 is a clean SIGTERM exit)."""
        for p in self.procs:
            if p.alive():
                p.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        codes = []
        for p in self.procs:
            try:
                codes.append(p.process.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.process.kill()
                codes.append(p.process.wait())
        return codes
