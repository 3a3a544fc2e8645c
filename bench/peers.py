"""splitserve serve against vLLM's CPU build, side by side, driven by the same client.

Each server runs alone on the machine in turn, on the same fp32 SmolLM2 weights (the HF folder
that the peer script `vllm-cpu.sh install` converts from the shipped GGUF; splitserve serves
that folder too), and `splitserve bench` drives it: streaming chat, fixed seed, a closed loop at
concurrency 1, 4 and 16, input 256 / output 128 tokens and input 2048 / output 128 tokens
(`ignore_eos`, so every request produces its 128 tokens).

Servers (`--servers`):
  splitserve-agg          splitserve serve --aggregated (1 worker; on CPU pinned to every core of
                          the machine, below 8 cores none is reserved: engine/cpu_placement.py)
  splitserve-agg-float    the same with --cpu-bind none (torch's threads unpinned)
  splitserve-agg2         splitserve serve --aggregated --workers 2 (one worker pinned to each core)
  splitserve-1p1d         splitserve serve (1 prefill + 1 decode worker, KV over NIXL)
  vllm                    vllm-cpu.sh serve (vLLM 0.32 CPU build, its defaults: compute bound to
                          core 0); `--vllm-script` or $SPLITSERVE_PEER_VLLM names the peer script

Per run: output tokens/s, TTFT p50/p99, ITL p50/p99 (ITL per request: decode time / (tokens - 1)),
and the machine's load: `foreign_cores`, the CPU (in cores) that processes other than the server's
process tree and the client used during the run, from /proc/stat; a run above `--max-foreign`
cores is rerun (up to `--retries` times) and the quietest kept. Each server's start-up time is
launch → `/v1/models` answers.

Ratios (splitserve ÷ vLLM, same shape and concurrency, same invocation) are the figures to read:
absolute numbers drift by tens of percent on these shared 2-core machines.

    python bench/peers.py --vllm-script PATH/vllm-cpu.sh     # everything (~40 min on 2 cores)
    python bench/peers.py --servers splitserve-agg,vllm --shapes 256x128 --concurrency 1,16
    python bench/peers.py --quick                            # 256x128 at concurrency 1 and 4, fewer requests

Writes bench/results/peers.json (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

from bench_support import machine_jiffies, quietest, stop_group, wait_ready
from splitserve.hardware import write_report

ROOT = Path(__file__).resolve().parents[1]
SERVERS = ("splitserve-agg", "splitserve-agg-float", "splitserve-agg2", "splitserve-1p1d", "vllm")


@dataclass(slots=True)
class RunResult:
    server: str
    input_len: int
    output_len: int
    concurrency: int
    requests: int
    completed: int
    errors: int
    duration_s: float
    output_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    foreign_cores: float
    server_cores: float
    client_cores: float
    loadavg_1m: float
    attempt: int


# -- CPU accounting ------------------------------------------------------------------------
def _tree_cpu_s(root: int) -> dict[int, float]:
    """CPU seconds (user + system, with reaped children's) of each process in `root`'s tree."""
    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for proc in procs:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue                   # ended meanwhile
        out[proc.pid] = t.user + t.system + t.children_user + t.children_system
    return out


class CpuMeter:
    """Cores used during a window: the whole machine, the server's process tree, the client."""

    def __init__(self, server_pid: int):
        self.server_pid = server_pid
        self.hz = os.sysconf("SC_CLK_TCK")

    def start(self) -> None:
        self.t0, self.busy0, self.server0 = time.monotonic(), machine_jiffies()[0], _tree_cpu_s(self.server_pid)

    def stop(self, client_s: float) -> tuple[float, float, float]:
        elapsed = time.monotonic() - self.t0
        busy_s = (machine_jiffies()[0] - self.busy0) / self.hz
        server_s = sum(s - self.server0.get(pid, 0.0) for pid, s in _tree_cpu_s(self.server_pid).items())
        return max(busy_s - server_s - client_s, 0.0) / elapsed, server_s / elapsed, client_s / elapsed


# -- servers -----------------------------------------------------------------------------
def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_command(name: str, model_dir: str, port: int, vllm_script: str | None) -> list[str]:
    if name == "vllm":
        return ["bash", str(vllm_script), "serve", str(port)]
    cmd = [sys.executable, "-m", "splitserve", "serve", "--model", model_dir,
           "--served-model-name", "smollm2", "--port", str(port), "--grpc-port", "0"]
    if name.startswith("splitserve-agg"):
        cmd.append("--aggregated")
    if name == "splitserve-agg-float":
        cmd += ["--cpu-bind", "none"]
    if name == "splitserve-agg2":
        cmd += ["--workers", "2"]
    return cmd


# -- one client run --------------------------------------------------------------------------
def _bench(url: str, input_len: int, output_len: int, concurrency: int, requests: int,
           seed: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "splitserve", "bench", "--url", url, "--model", "smollm2",
           "--tokenizer", "smollm2", "--api", "chat", "--input-len", str(input_len),
           "--output-len", str(output_len), "--arrival", "concurrency", "--concurrency", str(concurrency),
           "--num-requests", str(requests), "--seed", str(seed), "--out", str(out),
           "--no-plots", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"splitserve bench failed ({proc.returncode}): {err[-2000:]}")
    return json.loads((out / "result.json").read_text())["summary"]


def _children_cpu_s() -> float:
    """CPU seconds of this process's reaped children: exact for the client run just waited for."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_one(server: str, url: str, meter: CpuMeter, input_len: int, output_len: int,
            concurrency: int, requests: int, seed: int, attempt: int, scratch: Path) -> RunResult:
    out = scratch / f"{server}-{input_len}-{concurrency}-{attempt}"
    loadavg = float(Path("/proc/loadavg").read_text().split()[0])
    client0 = _children_cpu_s()
    meter.start()
    summary = _bench(url, input_len, output_len, concurrency, requests, seed, out)
    client_s = _children_cpu_s() - client0
    foreign, server_cores, client_cores = meter.stop(client_s)
    dist = lambda key, q: (summary.get(key) or {}).get(q)  # noqa: E731
    return RunResult(
        server=server, input_len=input_len, output_len=output_len, concurrency=concurrency,
        requests=requests, completed=summary["num_ok"], errors=summary["num_errors"],
        duration_s=summary.get("duration_s") or 0.0,
        output_tokens_per_s=summary.get("output_tokens_per_s") or 0.0,
        ttft_p50_s=dist("ttft_s", "p50"), ttft_p99_s=dist("ttft_s", "p99"),
        itl_p50_s=dist("itl_s", "p50"), itl_p99_s=dist("itl_s", "p99"),
        foreign_cores=round(foreign, 3), server_cores=round(server_cores, 3),
        client_cores=round(client_cores, 3), loadavg_1m=loadavg, attempt=attempt)


def bench_server(server: str, model_dir: str, shapes: list[tuple[int, int]], concurrencies: list[int],
                 args, scratch: Path, console: Console) -> tuple[float, list[RunResult]]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(scratch / f"{server}.log", "w")
    env = dict(os.environ)
    t0 = time.monotonic()
    proc = subprocess.Popen(_server_command(server, model_dir, port, args.vllm_script), stdout=log,
                            stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
    results: list[RunResult] = []
    try:
        wait_ready(f"{url}/v1/models", proc, args.ready_timeout)
        startup = time.monotonic() - t0
        console.print(f"[bold]{server}[/] ready in {startup:.1f} s")
        meter = CpuMeter(proc.pid)
        # One short warm-up request per shape (compilation, caches), not measured.
        for input_len, _ in shapes:
            _bench(url, input_len, 8, 1, 1, args.seed + 1000, scratch / f"{server}-warm-{input_len}")
        for input_len, output_len in shapes:
            for conc in concurrencies:
                requests = max(args.min_requests, args.requests_per_client * conc)

                def attempt(n: int) -> RunResult:
                    r = run_one(server, url, meter, input_len, output_len, conc, requests, args.seed, n, scratch)
                    console.print(f"  {input_len}x{output_len} c={conc}: {r.output_tokens_per_s:.1f} tok/s, "
                                  f"TTFT p50 {r.ttft_p50_s}, ITL p50 {r.itl_p50_s}, "
                                  f"foreign {r.foreign_cores:.2f} cores")
                    return r

                results.append(quietest(attempt, lambda r: r.foreign_cores, args.retries, args.max_foreign))
    finally:
        stop_group(proc, 60)
        log.close()
    return startup, results


def _ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def compare(results: list[RunResult], baseline: str) -> list[dict]:
    by_key = {(r.server, r.input_len, r.concurrency): r for r in results}
    rows = []
    for r in results:
        base = by_key.get((baseline, r.input_len, r.concurrency))
        if r.server == baseline or base is None:
            continue
        rows.append({"server": r.server, "input_len": r.input_len, "concurrency": r.concurrency,
                     "tokens_per_s_ratio": _ratio(r.output_tokens_per_s, base.output_tokens_per_s),
                     "ttft_p50_ratio": _ratio(r.ttft_p50_s, base.ttft_p50_s),
                     "itl_p50_ratio": _ratio(r.itl_p50_s, base.itl_p50_s)})
    return rows


def _ms(v):
    return "-" if v is None else f"{v * 1000:.0f}"


def _x(v):
    return "-" if v is None else f"{v:.2f}×"


def print_tables(console: Console, results: list[RunResult], startups: dict, ratios: list[dict]) -> None:
    t = Table(title="splitserve vs vLLM CPU: streaming chat, same client, same fp32 weights")
    for col in ("server", "in×out", "conc", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
                "done", "foreign cores"):
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(r.server, f"{r.input_len}×{r.output_len}", str(r.concurrency), f"{r.output_tokens_per_s:.1f}",
                  _ms(r.ttft_p50_s), _ms(r.ttft_p99_s), _ms(r.itl_p50_s), _ms(r.itl_p99_s),
                  f"{r.completed}/{r.requests}", f"{r.foreign_cores:.2f}")
    console.print(t)
    s = Table(title="start-up to ready")
    s.add_column("server")
    s.add_column("seconds", justify="right")
    for name, sec in startups.items():
        s.add_row(name, f"{sec:.1f}")
    console.print(s)
    if ratios:
        q = Table(title="ratios: server ÷ vLLM (tok/s: higher is better; TTFT, ITL: lower is better)")
        for col in ("server", "input", "conc", "tok/s", "TTFT p50", "ITL p50"):
            q.add_column(col, justify="right")
        for row in ratios:
            q.add_row(row["server"], str(row["input_len"]), str(row["concurrency"]),
                      _x(row["tokens_per_s_ratio"]), _x(row["ttft_p50_ratio"]), _x(row["itl_p50_ratio"]))
        console.print(q)


def targets(ratios: list[dict]) -> dict:
    """Issue 20's targets, on the aggregated server at 256×128."""
    get = lambda c, k: next((r[k] for r in ratios if r["server"] == "splitserve-agg"  # noqa: E731
                             and r["input_len"] == 256 and r["concurrency"] == c), None)
    checks = {
        "tokens_per_s_c16_ge_1.5": (get(16, "tokens_per_s_ratio"), lambda v: v >= 1.5),
        "tokens_per_s_c1_ge_1.0": (get(1, "tokens_per_s_ratio"), lambda v: v >= 1.0),
        "ttft_p50_c4_le_0.7": (get(4, "ttft_p50_ratio"), lambda v: v <= 0.7),
        "itl_p50_c4_le_1.0": (get(4, "itl_p50_ratio"), lambda v: v <= 1.0),
    }
    return {name: {"ratio": v, "met": None if v is None else ok(v)} for name, (v, ok) in checks.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default=",".join(SERVERS))
    p.add_argument("--shapes", default="256x128,2048x128", help="INPUTxOUTPUT,... tokens")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests-per-client", type=int, default=2,
                   help="requests per run = this × concurrency (at least --min-requests)")
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-foreign", type=float, default=0.3, help="rerun a run whose foreign load exceeds this (cores)")
    p.add_argument("--retries", type=int, default=1)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--model-dir", default=None, help="fp32 HF folder (default: `vllm-cpu.sh model`)")
    p.add_argument("--vllm-script", default=os.environ.get("SPLITSERVE_PEER_VLLM"),
                   help="the peer script vllm-cpu.sh (default: $SPLITSERVE_PEER_VLLM)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "peers.json")
    args = p.parse_args(argv)
    if args.quick:
        args.shapes, args.concurrency, args.requests_per_client = "256x128", "1,4", 1
    servers = [s for s in args.servers.split(",") if s]
    unknown = set(servers) - set(SERVERS)
    if unknown:
        p.error(f"unknown servers {sorted(unknown)}; choose from {', '.join(SERVERS)}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if args.vllm_script is None and ("vllm" in servers or args.model_dir is None):
        p.error("name the peer script with --vllm-script (or $SPLITSERVE_PEER_VLLM)")
    model_dir = args.model_dir or subprocess.run(["bash", str(args.vllm_script), "model"], check=True,
                                                 capture_output=True, text=True).stdout.strip()
    if not Path(model_dir, "config.json").is_file():
        p.error(f"{model_dir} is not an HF model folder: run `vllm-cpu.sh install` first")
    console = Console(width=160)
    startups: dict[str, float] = {}
    results: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        for server in servers:
            startups[server], runs = bench_server(server, model_dir, shapes, concurrencies, args, Path(tmp), console)
            results.extend(runs)
    ratios = compare(results, "vllm") if "vllm" in servers else []
    print_tables(console, results, startups, ratios)
    met = targets(ratios)
    write_report(args.out, {"benchmark": "peers", "model_dir": model_dir, "shapes": args.shapes,
                            "concurrency": concurrencies, "startup_s": startups,
                            "runs": [asdict(r) for r in results], "ratios_vs_vllm": ratios,
                            "targets": met})
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
