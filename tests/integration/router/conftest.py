"""A real etcd server and real worker/frontend processes for the router tests.

etcd comes from Debian's etcd-server package (scripts/install-test-deps.sh); it
listens on random ports on 127.0.0.1 with a temporary data directory and can
be stopped and restarted on the same ports (the outage test). A missing etcd
fails the tests, never skips them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import pytest

from splitserve.net import free_port

CHILD_ENV = {"SPLITSERVE_TEST_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@dataclass
class Proc:
    process: subprocess.Popen
    lines: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, argv: list[str]) -> "Proc":
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, **CHILD_ENV})
        proc = cls(p)
        threading.Thread(target=proc._read, daemon=True).start()
        return proc

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for_line(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r}:\n" + "\n".join(self.lines[-50:]))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class Etcd:
    def __init__(self, data_dir: str):
        if shutil.which("etcd") is None:
            pytest.fail("etcd is not installed: run scripts/install-test-deps.sh (Debian package etcd-server)")
        self.data_dir = data_dir
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc: Proc | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        c, p = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        self.proc = Proc.start(["etcd", "--name", "test", "--data-dir", self.data_dir,
                                "--listen-client-urls", c, "--advertise-client-urls", c,
                                "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
                                "--initial-cluster", f"test={p}", "--log-level", "warn"])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{c}/health", timeout=1) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.1)
        raise AssertionError("etcd did not start:\n" + "\n".join(self.proc.lines))

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    server = Etcd(str(tmp_path_factory.mktemp("etcd")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def http_json(url: str, body: dict | None = None, timeout: float = 30.0):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as reply:
        text = reply.read()
    return json.loads(text) if text[:1] in b"{[" else text.decode()


def worker_stats(address: str):
    import grpc

    from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=5)
