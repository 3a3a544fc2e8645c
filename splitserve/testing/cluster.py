"""Real worker, frontend and etcd processes on loopback, for fault tests and the soak run.

Everything listens on free ports of 127.0.0.1, is waited for by polling (bounded), and
is stopped by whoever started it (`Cluster.close()` stops all it started, SIGKILL after
a grace period, so nothing outlives a test). Child processes run with one torch thread.

`idle_problems()` is the leak check every fault test ends with: a worker is idle when
its Stats say no KV block is held by a request, no transfer reservation is open, no
finished prefill still holds blocks, and no call or remote prefill is in flight.
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
from pathlib import Path

import grpc

from splitserve.net import free_port
from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc

CHILD_ENV = {"SPLITSERVE_TEST_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
READY_TIMEOUT_S = 120.0


@dataclass
class Proc:
    """A child process whose combined output is collected by a reader thread."""

    process: subprocess.Popen
    lines: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, argv: list[str], env: dict | None = None) -> "Proc":
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   stdin=subprocess.DEVNULL, env={**os.environ, **CHILD_ENV, **(env or {})})
        proc = cls(process)
        threading.Thread(target=proc._read, daemon=True).start()
        return proc

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.lines[-n:])

    def wait_for_line(self, pattern: str, timeout: float = READY_TIMEOUT_S) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r}:\n{self.tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal, wait up to `timeout`, then SIGKILL; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


@dataclass
class Worker:
    name: str
    role: str
    address: str
    proc: Proc

    def stats(self) -> worker_pb2.StatsResponse:
        return worker_stats(self.address)


@dataclass
class FrontendProc:
    proc: Proc
    port: int
    grpc_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def openai_url(self) -> str:
        return f"{self.base_url}/v1"

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=5) as reply:
            return reply.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of `name` whose labels include `labels` (0 when none)."""
        total = 0.0
        for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", self.metrics(), re.MULTILINE):
            have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total += float(m.group(2))
        return total

    def ready(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"{self.base_url}/ready", timeout=1) as reply:
                return json.loads(reply.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None


def worker_stats(address: str, timeout: float = 5.0) -> worker_pb2.StatsResponse:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=timeout)


def idle_problems(s: worker_pb2.StatsResponse) -> list[str]:
    """What a worker still holds (empty when idle)."""
    held = {"used KV blocks": s.num_used_kv_blocks, "transfer reservations": s.num_transfer_reservations,
            "held prefills": s.num_held_prefills, "remote prefills waiting": s.num_remote_prefill,
            "running": s.num_running, "waiting": s.num_waiting, "calls in flight": s.num_in_flight,
            "fenced KV blocks": s.num_fenced_kv_blocks}
    return [f"{v} {k}" for k, v in held.items() if v]


def wait_idle(workers: list[Worker], timeout: float) -> float:
    """Seconds until every worker is idle; AssertionError naming what is held after `timeout`."""
    start = time.monotonic()
    while True:
        problems = {w.name: p for w in workers if (p := idle_problems(w.stats()))}
        if not problems:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"workers not idle {timeout:.1f} s later: {problems}")
        time.sleep(0.02)


class Etcd:
    """A real etcd (Debian's etcd-server) on free loopback ports; restartable on the same ports."""

    def __init__(self, data_dir: str):
        if shutil.which("etcd") is None:
            raise AssertionError("etcd is not installed: run scripts/install-test-deps.sh (package etcd-server)")
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
        raise AssertionError("etcd did not start:\n" + self.proc.tail())

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None


class Cluster:
    """Workers and frontends for one model; `close()` stops everything it started."""

    def __init__(self, model: str | Path, kv_cache_gib: float = 0.05, transfer: str = "tcp"):
        self.model = str(model)
        self.kv_cache_gib = kv_cache_gib
        self.transfer = transfer
        self.workers: dict[str, Worker] = {}
        self.frontends: list[FrontendProc] = []

    def start_worker(self, name: str, role: str, *extra: str, port: int | None = None) -> Worker:
        """Start (or restart, on the same `port`) a worker; wait_workers() waits for it."""
        port = port or free_port()
        argv = ["splitserve", "--log-level", "info", "worker", "--role", role, "--model", self.model,
                "--port", str(port), "--worker-id", name, "--threads", "1", "--kv-cache-gib", str(self.kv_cache_gib),
                *extra]
        if role != "both":
            argv += ["--transfer", self.transfer]
        worker = Worker(name, role, f"127.0.0.1:{port}", Proc.start(argv))
        self.workers[name] = worker
        return worker

    def wait_workers(self, timeout: float = READY_TIMEOUT_S) -> None:
        for w in self.workers.values():
            if w.proc.process.poll() is None:
                w.proc.wait_for_line(rf"worker {re.escape(w.name)} ready", timeout)

    def start_frontend(self, *extra: str, workers: list[Worker] | None = None) -> FrontendProc:
        port, grpc_port = free_port(), free_port()
        argv = ["splitserve", "--log-level", "info", "frontend", "--model", self.model, "--port", str(port),
                "--grpc-port", str(grpc_port), *extra]
        for w in self.workers.values() if workers is None else workers:
            argv += ["--worker", f"{w.role}={w.address}"]
        front = FrontendProc(Proc.start(argv), port, grpc_port)
        self.frontends.append(front)
        return front

    def wait_frontend(self, front: FrontendProc, num_workers: int | None = None,
                      timeout: float = READY_TIMEOUT_S) -> None:
        """Ready, and every worker ready (or `num_workers` workers known through etcd)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = front.ready()
            if r and r.get("all_workers_ready") and (
                    num_workers is None or front.metrics().count("splitserve_router_index_blocks{") >= num_workers):
                return
            if front.proc.process.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError("frontend not ready:\n" + front.proc.tail())

    def live_workers(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.proc.process.poll() is None]

    def close(self) -> list[str]:
        """SIGTERM everything, SIGKILL what is left after 15 s; returns the argv heads of the
        processes that needed SIGKILL (a shutdown that hangs is worth knowing about)."""
        procs = [f.proc for f in self.frontends] + [w.proc for w in self.workers.values()]
        for p in procs:
            if p.process.poll() is None:
                p.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        killed = []
        for p in procs:
            try:
                p.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.process.kill()
                p.process.wait()
                killed.append(" ".join(p.process.args[3:10]) + "\n" + p.tail(15))
        if killed:
            print("cluster: needed SIGKILL after SIGTERM:\n" + "\n".join(killed), flush=True)
        return killed
