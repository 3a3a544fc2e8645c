"""End to end: 4 aggregated workers (random 4-layer Llama), real frontends, real etcd.

The workers start once for the module and register in etcd (lease TTL 3 s).
Frontends are started per test: statically addressed (what `serve` does) or
discovering the workers in etcd.
"""

from __future__ import annotations

import re
import signal
import time
import urllib.error

import pytest

from splitserve.testing.waiting import wait_until
from splitserve.testing.workers import worker_stats

from .conftest import Proc, free_port, http_json

NUM_WORKERS = 4
TTL_S = 3
PREFIX = list(range(1000, 1000 + 320))          # 20 blocks of 16
WORKER_PROCS: dict[str, Proc] = {}


@pytest.fixture(scope="module")
def workers(llama_dir, etcd):
    procs, addresses = [], []
    try:
        for i in range(NUM_WORKERS):
            port = free_port()
            procs.append(Proc.start(["splitserve", "worker", "--model", str(llama_dir), "--port", str(port),
                                     "--worker-id", f"w{i}", "--threads", "1", "--kv-cache-gib", "0.05",
                                     "--etcd", etcd.endpoint, "--etcd-ttl", str(TTL_S)]))
            addresses.append(f"127.0.0.1:{port}")
        for p in procs:
            p.wait_for_line(r"ready \(transfer", 120)
        WORKER_PROCS.update(zip(addresses, procs))
        yield addresses
    finally:
        for p in procs:
            p.stop()


class Frontend:
    def __init__(self, llama_dir, args: list[str]):
        self.port = free_port()
        self.proc = Proc.start(["splitserve", "--log-level", "info", "frontend", "--model", str(llama_dir),
                                "--port", str(self.port), *args])
        self.base = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, num_workers: int = NUM_WORKERS, timeout: float = 30) -> None:
        def ready() -> bool:
            try:
                r = http_json(f"{self.base}/ready", timeout=1)
                return bool(r.get("all_workers_ready") and self.num_workers() == num_workers)
            except (urllib.error.URLError, OSError, ValueError):
                return False

        wait_until(ready, timeout=timeout, interval=0.05, what=f"the frontend to be ready with {num_workers} workers",
                   details=lambda: "frontend output:\n" + self.proc.tail(40))

    def metrics(self) -> str:
        return http_json(f"{self.base}/metrics", timeout=5)

    def num_workers(self) -> int:
        return len(set(re.findall(r'splitserve_router_index_blocks\{worker="([^"]+)"\}', self.metrics())))

    def index_blocks(self) -> dict[str, float]:
        return {w: float(v) for w, v in re.findall(r'splitserve_router_index_blocks\{worker="([^"]+)"\} (\S+)',
                                                   self.metrics())}

    def complete(self, prompt: list[int], timeout: float = 60):
        return http_json(f"{self.base}/v1/completions", {"model": self.model(), "prompt": prompt,
                                                          "max_tokens": 2, "temperature": 0}, timeout)

    def model(self) -> str:
        return http_json(f"{self.base}/v1/models")["data"][0]["id"]

    def stop(self, sig=signal.SIGTERM) -> None:
        self.proc.stop(sig)


def static_frontend(llama_dir, addresses, router="kv") -> Frontend:
    f = Frontend(llama_dir, ["--router", router, *[a for addr in addresses for a in ("--worker", f"both={addr}")]])
    f.wait_ready()
    return f


def counters(addresses, field):
    return [getattr(worker_stats(a), field) for a in addresses]


def holder_of(frontend: Frontend, addresses, prompt) -> int:
    before = counters(addresses, "num_requests")
    frontend.complete(prompt)
    after = counters(addresses, "num_requests")
    return [i for i in range(len(addresses)) if after[i] > before[i]][0]


def wait_index(frontend: Frontend, worker_id: str, timeout: float = 5.0) -> float:
    """Seconds until the frontend's index holds the prefix's blocks on `worker_id`."""
    start = time.monotonic()
    wait_until(lambda: frontend.index_blocks().get(worker_id, 0) >= len(PREFIX) // 16, timeout=timeout,
               interval=0.05, what=f"the index of {worker_id} to be rebuilt", details=frontend.index_blocks)
    return time.monotonic() - start


def test_kv_routes_a_shared_prefix_to_its_holder_and_survives_a_restart(llama_dir, workers):
    front = static_frontend(llama_dir, workers, "kv")
    try:
        holder = holder_of(front, workers, PREFIX + [1])
        wait_index(front, f"w{holder}")
        hits = counters(workers, "num_prefix_hit_tokens")
        for i in range(6):
            front.complete(PREFIX + [2 + i, 5, 7])
        gained = [b - a for a, b in zip(hits, counters(workers, "num_prefix_hit_tokens"))]
        assert gained[holder] >= 6 * (len(PREFIX) - 16), gained
        assert sum(gained) == gained[holder], gained
        front.stop(signal.SIGKILL)
        # A new frontend (router) rebuilds its index from the workers' events alone.
        front = Frontend(llama_dir, ["--router", "kv",
                                     *[a for addr in workers for a in ("--worker", f"both={addr}")]])
        front.wait_ready()
        assert wait_index(front, f"w{holder}") < 2.0
        hits = counters(workers, "num_prefix_hit_tokens")
        front.complete(PREFIX + [99, 98])
        gained = [b - a for a, b in zip(hits, counters(workers, "num_prefix_hit_tokens"))]
        assert gained[holder] >= len(PREFIX) - 16 and sum(gained) == gained[holder], gained
        assert 'splitserve_router_last_decision{leg="decode",policy="kv"' in front.metrics()
    finally:
        front.stop()


def test_round_robin_spreads_a_shared_prefix(llama_dir, workers):
    front = static_frontend(llama_dir, workers, "round-robin")
    try:
        before = counters(workers, "num_requests")
        prefix = list(range(5000, 5000 + 160))
        for i in range(8):
            front.complete(prefix + [i])
        after = counters(workers, "num_requests")
        assert [b - a for a, b in zip(before, after)] == [2, 2, 2, 2]
    finally:
        front.stop()


def test_etcd_lease_loss_new_worker_and_outage(llama_dir, workers, etcd):
    front = Frontend(llama_dir, ["--router", "kv", "--etcd", etcd.endpoint])
    front.wait_ready()
    victim = None
    try:
        # A worker that stops refreshing its lease (SIGSTOP) leaves routing within the TTL.
        victim_proc = _worker_proc_pid(workers[3])
        victim_proc.send_signal(signal.SIGSTOP)
        victim = victim_proc
        wait_until(lambda: front.num_workers() == NUM_WORKERS - 1, timeout=TTL_S + 2,
                   what="the router to drop the worker whose lease lapsed", details=front.index_blocks)
        for i in range(6):
            front.complete(list(range(7000 + 50 * i, 7000 + 50 * i + 40)), timeout=20)
        # It comes back (a new registration) and is routed to again.
        victim.send_signal(signal.SIGCONT)
        victim = None
        front.wait_ready(NUM_WORKERS, timeout=TTL_S + 10)
        # etcd stopped for 10 s: requests keep succeeding with the last known workers.
        etcd.stop()
        end = time.monotonic() + 10
        n = 0
        while time.monotonic() < end:
            front.complete(list(range(9000 + n, 9000 + n + 40)), timeout=20)
            n += 1
        assert n >= 5
        etcd.start()
        front.wait_ready(NUM_WORKERS, timeout=TTL_S + 15)
        front.complete(PREFIX + [3])
    finally:
        if victim is not None:
            victim.send_signal(signal.SIGCONT)
        front.stop()


def _worker_proc_pid(address: str):
    return WORKER_PROCS[address].process
