"""Real `splitserve worker` and `splitserve frontend` processes on loopback, for every test
and benchmark that needs a deployment it can take apart: fault, security, fuzz and
serving tests, and the soak run.

A `Cluster` starts workers (any roles, restartable on the same port) and frontends in
front of them, each on free ports of 127.0.0.1 with one torch thread and its output
collected (processes.py). Starting does not wait: `Worker.wait_ready` /
`Cluster.wait_workers` and `Frontend.wait_ready` do, bounded, so a test can start
several processes and let them load side by side. `Cluster.close()` stops everything it
started (SIGTERM, then SIGKILL after a grace period) and returns the exit codes, so a
test can check that nothing crashed; `assert_clean_exit` is that check. Etcd lives in
etcd.py, the worker Stats and the leak check in workers.py.
"""

from __future__ import annotations

import json
import re
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from splitserve.net import free_port
from splitserve.proto.v1 import worker_pb2
from splitserve.testing.metrics import sample_sum
from splitserve.testing.processes import READY_TIMEOUT_S, Proc, stop_all
from splitserve.testing.waiting import wait_until
from splitserve.testing.workers import worker_stats

CLOSE_GRACE_S = 20.0


@dataclass
class Worker:
    name: str
    role: str
    address: str
    proc: Proc
    transfer: str          # the KV transfer backend its ready line must name ("none" for role both)

    def stats(self) -> worker_pb2.StatsResponse:
        return worker_stats(self.address)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until the worker serves, with the transfer backend it was started with."""
        self.proc.wait_for_line(rf"worker {re.escape(self.name)} ready \(transfer {self.transfer}\)", timeout)


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

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        """(status, body); (0, b"") when nothing answers."""
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=timeout, context=self.ssl_context()) as reply:
                return reply.status, reply.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except (urllib.error.URLError, OSError):
            return 0, b""

    def metrics(self) -> str:
        """The /metrics text (raises OSError when the frontend does not answer)."""
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=5, context=self.ssl_context()) as reply:
            return reply.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of `name` whose labels include `labels` (0 when none)."""
        return sample_sum(self.metrics(), name, **labels)

    def ready(self) -> dict | None:
        """/ready's answer when it says ready (200), else None."""
        status, body = self.get("/ready", timeout=1)
        try:
            return json.loads(body) if status == 200 else None
        except ValueError:
            return None

    def wait_ready(self, num_workers: int | None = None, timeout: float = READY_TIMEOUT_S) -> None:
        """Ready, and every worker ready (or `num_workers` workers known through etcd)."""
        def ready() -> bool:
            assert self.proc.alive(), "frontend exited before it was ready:\n" + self.proc.tail()
            r = self.ready()
            return bool(r and r.get("all_workers_ready") and (
                num_workers is None or self.metrics().count("splitserve_router_index_blocks{") >= num_workers))

        wait_until(ready, timeout=timeout, what="the frontend to be ready",
                   details=lambda: "frontend output:\n" + self.proc.tail())


class Cluster:
    """Workers and frontends for one model; `close()` stops everything it started."""

    def __init__(self, model: str | Path, kv_cache_gib: float = 0.05, transfer: str = "tcp",
                 log_level: str = "info"):
        self.model = str(model)
        self.kv_cache_gib = kv_cache_gib
        self.transfer = transfer            # for prefill and decode workers
        self.log_level = log_level
        self.workers: dict[str, Worker] = {}
        self.frontends: list[Frontend] = []
        self.procs: list[Proc] = []         # everything started, in order
        self.killed: list[Proc] = []        # what close() had to SIGKILL

    def start_worker(self, name: str, role: str, *extra: str, port: int | None = None,
                     env: dict | None = None) -> Worker:
        """Start (or restart, on the same `port`) a worker; its wait_ready() waits for it."""
        port = port or free_port()
        argv = ["splitserve", "--log-level", self.log_level, "worker", "--role", role, "--model", self.model,
                "--port", str(port), "--worker-id", name, "--threads", "1", "--kv-cache-gib", str(self.kv_cache_gib),
                *extra]
        transfer = "none"
        if role != "both":
            argv += ["--transfer", self.transfer]
            transfer = self.transfer
        worker = Worker(name, role, f"127.0.0.1:{port}", Proc.start(argv, env), transfer)
        self.workers[name] = worker
        self.procs.append(worker.proc)
        return worker

    def start_rank_group(self, name: str, role: str, world_size: int, *extra: str,
                         join_timeout_s: float | None = None) -> tuple[Worker, list[Proc]]:
        """A tensor-parallel worker group as pods run it: `world_size` independent `splitserve
        worker` processes with the same flags, told their rank, the world size and rank 0's
        leader address through SPLITSERVE_TP_* (none forked from another). Ranks 1.. start
        first (they wait for the leader). Returns rank 0's Worker (its wait_ready waits for
        the whole group) and the other ranks' processes."""
        leader = f"127.0.0.1:{free_port()}"
        env = {"SPLITSERVE_TP_WORLD_SIZE": str(world_size), "SPLITSERVE_TP_LEADER": leader}
        if join_timeout_s is not None:
            env["SPLITSERVE_TP_JOIN_TIMEOUT"] = str(join_timeout_s)
        others = []
        for rank in range(1, world_size):
            argv = ["splitserve", "--log-level", self.log_level, "worker", "--role", role, "--model", self.model,
                    "--worker-id", f"{name}-rank{rank}", "--threads", "1", "--kv-cache-gib", str(self.kv_cache_gib),
                    *(["--transfer", self.transfer] if role != "both" else []), *extra]
            others.append(Proc.start(argv, {**env, "SPLITSERVE_TP_RANK": str(rank)}))
        self.procs += others
        return self.start_worker(name, role, *extra, env={**env, "SPLITSERVE_TP_RANK": "0"}), others

    def start_kvstore(self, capacity_gib: float, *extra: str, port: int | None = None) -> tuple[Proc, str]:
        """A `splitserve kvstore` (restartable on the same `port`); returns it and its HOST:PORT once
        it listens. Workers reach it with `--kv-store HOST:PORT`."""
        port = port or free_port()
        argv = ["splitserve", "--log-level", self.log_level, "kvstore", "--capacity-gib", str(capacity_gib),
                "--port", str(port), *extra]
        proc = Proc.start(argv)
        self.procs.append(proc)
        proc.wait_for_line(r"kvstore listening on ")
        return proc, f"127.0.0.1:{port}"

    def wait_workers(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until every worker still running is ready (one killed on purpose is passed over)."""
        for w in self.live_workers():
            w.wait_ready(timeout)

    def live_workers(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.proc.alive()]

    def start_frontend(self, *extra: str, workers: list[Worker] | None = None, env: dict | None = None,
                       https_ca: Path | None = None) -> Frontend:
        """A frontend in front of `workers` (default: all; [] for etcd discovery). With
        `https_ca` it is reached over HTTPS (pass its --tls-cert/--tls-key in `extra`)."""
        port, grpc_port = free_port(), free_port()
        argv = ["splitserve", "--log-level", self.log_level, "frontend", "--model", self.model,
                "--port", str(port), "--grpc-port", str(grpc_port), *extra]
        for w in self.workers.values() if workers is None else workers:
            argv += ["--worker", f"{w.role}={w.address}"]
        front = Frontend(Proc.start(argv, env), port, grpc_port, "https" if https_ca else "http", https_ca)
        self.frontends.append(front)
        self.procs.append(front.proc)
        return front

    def outputs(self) -> str:
        return "\n".join(p.output for p in self.procs)

    def assert_clean_exit(self, codes: list[int], num_procs: int) -> None:
        """After close(): every one of `num_procs` processes exited 0, none printed a traceback."""
        assert codes == [0] * num_procs, self.outputs()[-3000:]
        assert "Traceback" not in self.outputs(), self.outputs()[-6000:]

    def close(self, grace_s: float = CLOSE_GRACE_S) -> list[int]:
        """Stop everything still running; their exit codes in start order (0 is a clean SIGTERM
        exit). Whatever needed a SIGKILL is printed and kept in `killed` (a shutdown that
        hangs is worth knowing about)."""
        codes, killed = stop_all(self.procs, grace_s)
        self.killed += killed
        if killed:
            print("cluster: needed SIGKILL after SIGTERM:\n"
                  + "\n".join(" ".join(p.process.args[3:10]) + "\n" + p.tail(15) for p in killed), flush=True)
        return codes

