"""Real `splitserve serve` / `splitserve worker` processes for the serving tests.

Servers listen on free ports on 127.0.0.1, are waited for by polling (bounded),
and are always torn down, with a check that no child process outlives them.
One server per test module keeps the suite within a few minutes on 2 cores.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from splitserve.net import free_port
from splitserve.testing.cluster import Proc as ClusterProc

READY_TIMEOUT_S = 120.0


@dataclass
class Proc(ClusterProc):
    """splitserve.testing.cluster.Proc, but a process that ignores its stop signal fails the test."""

    def wait_for_line(self, pattern: str, timeout: float = READY_TIMEOUT_S) -> re.Match:
        try:
            return super().wait_for_line(pattern, timeout)
        except AssertionError:
            raise AssertionError(f"no line matching {pattern!r}; output so far:\n{self.output}") from None

    def children(self) -> list[int]:
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.process.pid:
                pids.append(int(stat.parent.name))
        return pids

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"did not stop within {timeout} s on {sig!r}:\n{self.output}")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class Server:
    proc: Proc
    base_url: str
    grpc_address: str
    worker_addresses: list[str]
    child_pids: list[int]
    workers: dict[str, str] = field(default_factory=dict)     # name (prefill-0, decode-1, worker-0) -> address

    @property
    def openai_url(self) -> str:
        return f"{self.base_url}/v1"

    def role(self, prefix: str) -> list[str]:
        """Addresses of the workers whose names start with `prefix` (prefill, decode, worker), in order."""
        return [a for name, a in sorted(self.workers.items()) if name.startswith(prefix)]


def start_serve(model: str | None, *extra: str, env: dict | None = None, num_workers: int = 1,
                aggregated: bool = True) -> Server:
    """`splitserve serve` on free ports (host left to its default); `num_workers` is how many
    workers it must report (with `aggregated=False` pass --prefill-workers/--decode-workers in
    `extra`); `model` None leaves --model to its default."""
    port, grpc_port = free_port(), free_port()
    mode = ["--aggregated", "--workers", str(num_workers)] if aggregated else []
    mode += [] if model is None else ["--model", model]
    proc = Proc.start(["splitserve", "serve", *mode, "--port", str(port),
                       "--grpc-port", str(grpc_port), "--threads", "1", "--kv-cache-gib", "0.05", *extra], env=env)
    base = f"http://127.0.0.1:{port}"
    try:          # the URL it prints is the one we use
        proc.wait_for_line(rf"splitserve is ready: {re.escape(base)}/v1 .*gRPC 127\.0\.0\.1:{grpc_port}\b",
                           READY_TIMEOUT_S)
        assert http_ok(f"{base}/ready"), proc.output
        workers = {m.group(1): m.group(2) for line in proc.lines
                   if (m := re.search(r"((?:worker|prefill|decode)-\d+) ready .* at (\S+)$", line))}
        assert len(workers) == num_workers, proc.output
        return Server(proc, base, f"127.0.0.1:{grpc_port}", [workers[n] for n in sorted(workers)],
                      proc.children(), workers)
    except BaseException:
        proc.stop()
        raise


def stop_serve(server: Server, sig: int = signal.SIGTERM) -> None:
    code = server.proc.stop(sig)
    assert code == 0, server.proc.output
    assert len(server.child_pids) >= 2    # workers and the frontend
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in server.child_pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in server.child_pids if alive(pid)], "serve left orphan processes"


def worker_stats(address: str):
    from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=5)


@pytest.fixture(scope="module")
def llama_server(llama_dir):
    server = start_serve(str(llama_dir))
    try:
        yield server
    finally:
        stop_serve(server)
