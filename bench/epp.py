"""What the endpoint picker costs and what it gives, behind a real Envoy (issue 40).

The deployment is tests/integration/gateway's, on loopback: two worker "pods" (`splitserve worker
--role both`, SmolLM2, one torch thread each, a KV pool of `--kv-cache-gib` that cannot hold every
tenant's prefix, and each pod's `splitserve frontend --gateway`), `splitserve epp` over them and
Envoy 1.40.0 (splitserve/testing/envoy.py) with two listeners: `epp` (ext_proc to the picker,
ORIGINAL_DST to its pick, as GIE's gateways) and `round_robin` (Envoy balancing over the two pods
itself, no picker).

Part 1, the picker's cost: streamed completions of a short fresh prompt (nothing cached, one output
token) one at a time, in pairs (one through each listener, the order alternating), TTFT measured at
the client. `epp_added_ttft_p50_ms` = TTFT p50 through Envoy + picker − TTFT p50 through Envoy alone
(target ≤ 2 ms; llm-d reports 1.8-3 ms for its EPP); beside it the median of the pairs'
differences, which the prefill's own spread disturbs less. Both workers idle: the pick decides
nothing here.

Part 2, the pick: `splitserve bench --workload shared-prefix` (tenants sharing long system
prompts, a closed loop) through each listener, the deployment restarted before each run so both
start cold; `kv_vs_round_robin_ttft_p90` = TTFT p90 through the picker ÷ through round-robin
(target ≤ 0.5).

Each round runs both parts; `--rounds 3` reports min / median / max, and a target is met only when
every round meets it. Run it with nothing else on the machine.

    python bench/epp.py --rounds 3 --out bench/results/epp.json
    python bench/epp.py --quick              # one round, few requests: a smoke run

JSON (`--out`): the commit, CPU and load (splitserve.hardware.write_report; /proc/loadavg at start
and end), each round's figures, `epp_added_ttft_p50_ms` and `kv_vs_round_robin_ttft_p90` (median;
per round beside them), and the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from splitserve.hardware import write_report
from splitserve.net import free_port
from splitserve.services.engine.loading.smollm2 import resolve_smollm2
from splitserve.testing.cluster import Cluster
from splitserve.testing.envoy import EnvoyGateway, GatewayListener
from splitserve.testing.processes import Proc
from splitserve.testing.waiting import wait_until

SERVED = "smollm2"
TARGET_ADDED_MS = 2.0
TARGET_P90_RATIO = 0.5


class Deployment:
    """Two gateway pods, the picker, Envoy; `close()` stops it all."""

    def __init__(self, model: Path, kv_cache_gib: float, router: str = "kv"):
        self.cluster = Cluster(model, kv_cache_gib=kv_cache_gib, log_level="warning")
        workers = [self.cluster.start_worker(f"w{i}", "both") for i in (1, 2)]
        self.cluster.wait_workers()
        pods = [self.cluster.start_frontend("--gateway", "--served-model-name", SERVED, workers=[w]) for w in workers]
        for pod in pods:
            pod.wait_ready()
        self.endpoints = [f"127.0.0.1:{pod.port}" for pod in pods]
        epp_port = free_port()
        argv = ["splitserve", "--log-level", "warning", "epp", "--model", str(model), "--served-model-name", SERVED,
                "--host", "127.0.0.1", "--port", str(epp_port), "--health-port", str(free_port()),
                "--metrics-port", "-1", "--router", router]
        for w, endpoint in zip(workers, self.endpoints):
            argv += ["--worker", f"both={w.address}", "--endpoint", f"{w.address}={endpoint}"]
        self.epp = Proc.start(argv)
        self.cluster.procs.append(self.epp)
        self.epp.wait_for_line(r"epp: ext_proc listening on")
        self.gateway = EnvoyGateway.start(f"127.0.0.1:{epp_port}", self.endpoints, [
            GatewayListener("epp"), GatewayListener("round_robin", upstreams=self.endpoints)])
        wait_until(self.gateway.picker_healthy, timeout=30, what="Envoy to pass the picker's health check")
        # Until the picker serves a request, its workers may not be ready in its pool yet.
        wait_until(lambda: ttft(self.gateway.url("epp"), "warm-up") is not None, timeout=120,
                   what="a request through the picker")

    def close(self) -> None:
        self.gateway.close()
        self.cluster.close()


def ttft(base_url: str, prompt: str) -> float | None:
    """Seconds to the first streamed token of one completion (None: not a 200)."""
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    began = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as reply:
        if reply.status_code != 200:
            return None
        for line in reply.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                return time.perf_counter() - began
    return None


def overhead(d: Deployment, requests: int) -> dict:
    """TTFT p50 per listener over `requests` pairs, a fresh prompt each time (its first block unique)."""
    times: dict[str, list[float]] = {"epp": [], "round_robin": []}
    for i in range(requests):
        for listener in (("epp", "round_robin") if i % 2 else ("round_robin", "epp")):
            t = ttft(d.gateway.url(listener), f"{uuid.uuid4().hex[:12]} Say hi.")
            if t is None:
                raise RuntimeError(f"a request through {listener} failed:\n{d.cluster.outputs()[-3000:]}")
            times[listener].append(t)
    p50 = {k: statistics.median(v) for k, v in times.items()}
    pairs = [(a - b) * 1000 for a, b in zip(times["epp"], times["round_robin"])]
    return {"ttft_p50_ms": {k: v * 1000 for k, v in p50.items()},
            "added_ms": (p50["epp"] - p50["round_robin"]) * 1000, "paired_median_ms": statistics.median(pairs),
            "requests": requests}


def shared_prefix(d: Deployment, listener: str, args, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "splitserve", "bench", "--url", d.gateway.url(listener), "--model", SERVED,
                    "--tokenizer", str(args.model), "--api", "completions", "--workload", "shared-prefix",
                    "--tenants", str(args.tenants), "--prefix-len", str(args.prefix_len),
                    "--questions-per-tenant", str(args.questions), "--question-len", "32", "--output-len", "4",
                    "--arrival", "concurrency", "--concurrency", str(args.concurrency), "--seed", "0",
                    "--out", str(out), "--label", listener, "--no-plots", "--no-progress"],
                   check=True, stdout=subprocess.DEVNULL, timeout=3600)
    summary = json.loads((out / "result.json").read_text())["summary"]
    return {"ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p90_s": summary["ttft_s"]["p90"],
            "num_ok": summary["num_ok"], "num_errors": summary["num_errors"]}


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="one round, few requests (a smoke run)")
    p.add_argument("--overhead-requests", type=int, default=100, help="part 1: requests per listener")
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--questions", type=int, default=8, help="part 2: questions per tenant")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--kv-cache-gib", type=float, default=0.05,
                   help="each worker's KV pool (default 0.05: ~70 SmolLM2 blocks, two tenants' prefixes)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.quick:
        args.rounds, args.overhead_requests, args.questions = 1, 10, 3
    os.environ.setdefault("SPLITSERVE_TEST_THREADS", "1")
    args.model = resolve_smollm2(progress=False)
    console = Console()
    load_start = Path("/proc/loadavg").read_text().split()[:3]
    rounds = []
    with tempfile.TemporaryDirectory(prefix="bench-epp-") as scratch:
        for r in range(1, args.rounds + 1):
            row: dict = {}
            d = Deployment(args.model, args.kv_cache_gib)
            try:
                row["overhead"] = overhead(d, args.overhead_requests)
            finally:
                d.close()
            order = ("epp", "round_robin") if r % 2 else ("round_robin", "epp")
            for listener in order:
                d = Deployment(args.model, args.kv_cache_gib)
                try:
                    row[listener] = shared_prefix(d, listener, args, Path(scratch) / f"{listener}-r{r}")
                finally:
                    d.close()
            row["kv_vs_round_robin_ttft_p90"] = row["epp"]["ttft_p90_s"] / row["round_robin"]["ttft_p90_s"]
            console.print(f"round {r}: picker adds {row['overhead']['added_ms']:.2f} ms TTFT p50 (pairs: median "
                          f"{row['overhead']['paired_median_ms']:.2f} ms); shared-prefix "
                          f"TTFT p90 {row['epp']['ttft_p90_s'] * 1000:.0f} ms (picker) vs "
                          f"{row['round_robin']['ttft_p90_s'] * 1000:.0f} ms (round-robin) = "
                          f"{row['kv_vs_round_robin_ttft_p90']:.2f}")
            rounds.append(row)
    added = [r["overhead"]["added_ms"] for r in rounds]
    ratio = [r["kv_vs_round_robin_ttft_p90"] for r in rounds]
    table = Table(title="endpoint picker (bench/epp.py)")
    for column in ("round", "TTFT p50 ms: Envoy+EPP / Envoy", "added ms (≤ 2)", "shared-prefix TTFT p90 ms: EPP / RR",
                   "ratio (≤ 0.5)", "errors"):
        table.add_column(column)
    for i, r in enumerate(rounds, 1):
        o = r["overhead"]["ttft_p50_ms"]
        table.add_row(str(i), f"{o['epp']:.1f} / {o['round_robin']:.1f}", f"{r['overhead']['added_ms']:.2f}",
                      f"{r['epp']['ttft_p90_s'] * 1000:.0f} / {r['round_robin']['ttft_p90_s'] * 1000:.0f}",
                      f"{r['kv_vs_round_robin_ttft_p90']:.2f}",
                      f"{r['epp']['num_errors']} / {r['round_robin']['num_errors']}")
    console.print(table)
    met_added, met_ratio = all(a <= TARGET_ADDED_MS for a in added), all(x <= TARGET_P90_RATIO for x in ratio)
    console.print(f"added TTFT p50 ≤ {TARGET_ADDED_MS} ms in every round: {'met' if met_added else 'NOT met'} "
                  f"(min/median/max {min(added):.2f}/{statistics.median(added):.2f}/{max(added):.2f}); "
                  f"TTFT p90 ratio ≤ {TARGET_P90_RATIO}: {'met' if met_ratio else 'NOT met'} "
                  f"({min(ratio):.2f}/{statistics.median(ratio):.2f}/{max(ratio):.2f})")
    if args.out:
        write_report(args.out, {
            "benchmark": "epp", "load_average_start": load_start,
            "load_average_end": Path("/proc/loadavg").read_text().split()[:3], "args": {
                k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "rounds": rounds, "epp_added_ttft_p50_ms": statistics.median(added),
            "epp_added_ttft_p50_ms_rounds": spread(added), "kv_vs_round_robin_ttft_p90": statistics.median(ratio),
            "kv_vs_round_robin_ttft_p90_rounds": spread(ratio),
            "targets": {"epp_added_ttft_p50_ms": TARGET_ADDED_MS, "kv_vs_round_robin_ttft_p90": TARGET_P90_RATIO},
            "met": {"epp_added_ttft_p50_ms": met_added, "kv_vs_round_robin_ttft_p90": met_ratio}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
