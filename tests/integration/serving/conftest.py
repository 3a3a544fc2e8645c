"""Real `splitserve serve` / `splitserve worker` processes for the serving tests.

Servers listen on free ports on 127.0.0.1, are waited for by polling (bounded),
and are always torn down, with a check that no child process outlives them.
One server per test module keeps the suite within a few minutes on 2 cores.
`llama_server` is that server for the modules that need no flags of their own;
`client` (the official openai client) and `model_name` (the name it serves) go with it.
"""

from __future__ import annotations

import re
import signal
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import openai
import pytest

from splitserve.net import free_port
from splitserve.testing import processes
from splitserve.testing.openai_api import served_model_name
from splitserve.testing.processes import READY_TIMEOUT_S, pid_alive
from splitserve.testing.waiting import wait_until


@dataclass
class Proc(processes.Proc):
    """splitserve.testing.processes.Proc, but a process that ignores its stop signal fails the test."""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0, must_stop: bool = True) -> int:
        return super().stop(sig, timeout, must_stop)


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
    wait_until(lambda: not any(pid_alive(pid) for pid in server.child_pids), timeout=5, interval=0.05,
               what="serve's children to exit with it (no orphans)",
               details=lambda: f"still running: {[pid for pid in server.child_pids if pid_alive(pid)]}")


@pytest.fixture(scope="module")
def llama_server(llama_dir):
    server = start_serve(str(llama_dir))
    try:
        yield server
    finally:
        stop_serve(server)


@pytest.fixture(scope="module")
def client(llama_server) -> openai.OpenAI:
    """The official openai client on `llama_server`."""
    return openai.OpenAI(base_url=llama_server.openai_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(llama_server) -> str:
    return served_model_name(llama_server.openai_url)
