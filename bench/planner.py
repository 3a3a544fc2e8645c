"""SLO planner: goodput of `serve --autoscale` against every static prefill:decode split and aggregated.

The workload changes its mix halfway (DistServe's point: the best split depends on it):

- phase "decode-heavy": short prompts, long outputs (`--a-prompt`, `--a-output` tokens, Poisson
  arrivals at `--a-rate` req/s);
- phase "prefill-heavy": long prompts, short outputs (`--b-prompt`, `--b-output`, `--b-rate`).

Each configuration is one `splitserve serve` with at most `--max-workers` workers (the shipped
SmolLM2, fp32, one torch thread per worker, the kv router), driven by the same seeded arrivals
(prompts are random token ids, `ignore_eos`, streamed). Configurations, one after another:

- every static disaggregated split P:D with P + D = `--max-workers`;
- aggregated with `--max-workers` workers;
- the planner: `serve --autoscale --max-workers N`, starting disaggregated at 1P:1D (it chooses
  the split, and whether to disaggregate at all: `--autoscale-mode auto`; `--autoscale-interval`,
  `--autoscale-cooldown`).

Goodput (per phase): requests arriving in the phase that completed with TTFT ≤ `--ttft-ms` and a
mean inter-token latency ≤ `--itl-ms`, per second of the phase. The report has, per phase,
the planner's goodput ÷ the best static split's (`goodput_vs_best_static`, target ≥ 0.9) and,
over the whole run, the planner's against every static split (target: above each).

    python bench/planner.py --out bench/results/planner.json      # ~17 min on 2 cores
    python bench/planner.py --repeats 3 --out ...                  # medians of 3 (~50 min)

The defaults load each phase so that the split matters, measured on 2 cores with one thread
per worker (AMD EPYC, probes of each phase alone): at 2.0 req/s of 64 in / 96 out (192 output
tok/s), one decode worker (2P:1D) served 80 % of the requests within the SLO and two (1P:2D)
all of them; at 0.4 req/s of 512 in / 8 out (205 prompt tok/s), one prefill worker (1P:2D)
served 16-41 % in two runs and two all. So each static split fails one phase. At 2.5 req/s
(runs 6-12 in bench/README.md) three workers ran at ~94 % of what the ITL target lets them
decode, and goodput became a cliff: the same static split measured 2.41 and 1.43 req/s in two
runs. On 2 cores every worker after the second shares a core; the report records the CPU it
ran on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from bench_support import stop_group
from splitserve.hardware import write_report
from splitserve.net import free_port

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("decode-heavy", "prefill-heavy")
VOCAB = 49000


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float
    phase: str
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class Outcome:
    phase: str
    ok: bool
    ttft_s: float | None = None
    itl_s: float | None = None
    tokens: int = 0
    error: str | None = None         # why a request did not complete: the status and body, or the exception


@dataclass(slots=True)
class Record:
    config: str
    goodput: dict[str, float] = field(default_factory=dict)      # phase -> good requests / s
    completed: dict[str, int] = field(default_factory=dict)
    arrived: dict[str, int] = field(default_factory=dict)
    ttft_p90_s: dict[str, float | None] = field(default_factory=dict)
    itl_p90_s: dict[str, float | None] = field(default_factory=dict)
    decisions: list[str] = field(default_factory=list)             # the planner's log lines (planner only)
    failures: list[str] = field(default_factory=list)              # "phase: error" of each request that did not complete

    @property
    def total_goodput(self) -> float:
        return sum(self.goodput.values()) / max(len(self.goodput), 1)


def arrivals(args) -> list[Arrival]:
    rng = random.Random(args.seed)
    out, t = [], 0.0
    for phase, rate, prompt, output in (("decode-heavy", args.a_rate, args.a_prompt, args.a_output),
                                         ("prefill-heavy", args.b_rate, args.b_prompt, args.b_output)):
        end = t + args.phase_s
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                t = end
                break
            out.append(Arrival(t, phase, [rng.randrange(3, VOCAB) for _ in range(prompt)], output))
    return out


async def one(client: httpx.AsyncClient, url: str, a: Arrival, start: float) -> Outcome:
    await asyncio.sleep(max(0.0, start + a.at_s - time.monotonic()))
    sent = time.monotonic()
    body = {"model": "m", "prompt": a.prompt, "max_tokens": a.max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    times = []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as reply:
            if reply.status_code != 200:
                return Outcome(a.phase, False, error=f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}")
            async for line in reply.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    if json.loads(line[6:])["choices"][0].get("text"):
                        times.append(time.monotonic())
    except httpx.HTTPError as e:
        return Outcome(a.phase, False, error=f"{type(e).__name__}: {e} after {len(times)} chunks")
    if not times:
        return Outcome(a.phase, False, error="the stream ended without text")
    itl = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return Outcome(a.phase, True, times[0] - sent, itl, len(times))


async def drive(url: str, plan: list[Arrival]) -> list[Outcome]:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(limits=limits) as client:
        start = time.monotonic()
        return list(await asyncio.gather(*(one(client, url, a, start) for a in plan)))


def p90(values: list[float]) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.9 * len(values)))] if values else None


def run_config(name: str, argv: list[str], plan: list[Arrival], args, scratch: Path, console: Console) -> Record:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "splitserve", "serve", "--port", str(port), "--grpc-port", "0",
           "--served-model-name", "m", "--threads", "1", "--kv-cache-gib", "0.25", *argv]
    decisions: list[str] = []
    with open(scratch / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

        started = time.monotonic()
        ready = threading.Event()

        def follow() -> None:
            for line in proc.stdout:
                log.write(f"{time.monotonic() - started:7.2f} {line}")     # seconds since serve started
                if "autoscale: planner:" in line:
                    decisions.append(line.strip())
                if line.startswith("splitserve is ready: "):
                    ready.set()

        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        try:
            # serve's own line, not /v1/models: with --autoscale the frontend answers while serve
            # still runs the planner's profile (~45 s), before the autoscaler starts.
            deadline = time.monotonic() + 600
            while not ready.wait(0.5):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: serve exited (code {proc.returncode}) or printed no "
                                       f"'splitserve is ready' line within 600 s")
            log.write(f"{time.monotonic() - started:7.2f} [bench] the load starts\n")
            outcomes = asyncio.run(drive(url, plan))
        finally:
            stop_group(proc, 60)
            follower.join(10)
    record = Record(name, decisions=decisions)
    for phase in PHASES:
        mine = [o for o in outcomes if o.phase == phase]
        done = [o for o in mine if o.ok]
        good = [o for o in done if o.ttft_s <= args.ttft_ms / 1e3 and o.itl_s <= args.itl_ms / 1e3]
        record.goodput[phase] = len(good) / args.phase_s
        record.completed[phase], record.arrived[phase] = len(done), len(mine)
        record.ttft_p90_s[phase] = p90([o.ttft_s for o in done])
        record.itl_p90_s[phase] = p90([o.itl_s for o in done])
    record.failures = [f"{o.phase}: {o.error}" for o in outcomes if not o.ok]
    console.print(f"  {name}: goodput {record.goodput}, TTFT p90 {record.ttft_p90_s}, ITL p90 {record.itl_p90_s}"
                  + (f", {len(decisions)} planner decisions" if decisions else "")
                  + (f"; did not complete: {record.failures}" if record.failures else ""))
    return record


def median_record(name: str, runs: list[Record]) -> Record:
    """One configuration over its repeats: the median of each phase's goodput and p90s, the
    requests summed, the last repeat's planner decisions."""
    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    if len(runs) == 1:
        return runs[0]
    out = Record(name, decisions=runs[-1].decisions)
    for ph in PHASES:
        out.goodput[ph] = statistics.median(r.goodput[ph] for r in runs)
        out.completed[ph] = sum(r.completed[ph] for r in runs)
        out.arrived[ph] = sum(r.arrived[ph] for r in runs)
        out.ttft_p90_s[ph] = median([r.ttft_p90_s[ph] for r in runs])
        out.itl_p90_s[ph] = median([r.itl_p90_s[ph] for r in runs])
    out.failures = [f for r in runs for f in r.failures]
    return out


def configs(args) -> list[tuple[str, list[str]]]:
    m = args.max_workers
    out = [(f"static {p}P:{m - p}D", ["--prefill-workers", str(p), "--decode-workers", str(m - p)])
           for p in range(1, m)]
    out.append((f"aggregated x{m}", ["--aggregated", "--workers", str(m)]))
    out.append(("planner", ["--prefill-workers", "1", "--decode-workers", "1", "--autoscale", "--max-workers", str(m),
                            "--slo-ttft-p90-ms", str(args.ttft_ms), "--slo-itl-p90-ms", str(args.itl_ms),
                            "--autoscale-interval", str(args.interval_s),
                            "--autoscale-cooldown", str(args.cooldown_s)]))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-workers", type=int, default=3)
    p.add_argument("--phase-s", type=float, default=100.0, help="seconds per phase")
    p.add_argument("--a-rate", type=float, default=2.0, help="decode-heavy phase: requests/s")
    p.add_argument("--a-prompt", type=int, default=64)
    p.add_argument("--a-output", type=int, default=96)
    p.add_argument("--b-rate", type=float, default=0.4, help="prefill-heavy phase: requests/s")
    p.add_argument("--b-prompt", type=int, default=512)
    p.add_argument("--b-output", type=int, default=8)
    p.add_argument("--ttft-ms", type=float, default=6000.0, help="SLO: time to first token")
    p.add_argument("--itl-ms", type=float, default=400.0, help="SLO: mean inter-token latency of a request")
    p.add_argument("--interval-s", type=float, default=5.0, help="the planner's --autoscale-interval")
    p.add_argument("--cooldown-s", type=float, default=30.0, help="the planner's --autoscale-cooldown")
    p.add_argument("--configs", default="", help="run only configurations whose name contains one of these "
                                                 "(comma-separated; default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="run every configuration this many times, round robin, and report each phase's median "
                        "(the same seeded arrivals each time: the spread is the machine's)")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="keep each configuration's `splitserve serve` log here (default: a temporary folder)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "planner.json")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    console = Console(width=200)
    plan = arrivals(args)
    console.print(f"{len(plan)} requests over 2 × {args.phase_s:g} s; SLO TTFT ≤ {args.ttft_ms:g} ms, "
                  f"ITL ≤ {args.itl_ms:g} ms; at most {args.max_workers} workers")
    wanted = [c for c in args.configs.split(",") if c]
    chosen = [(name, extra) for name, extra in configs(args) if not wanted or any(w in name for w in wanted)]
    runs: dict[str, list[Record]] = {name: [] for name, _ in chosen}
    with tempfile.TemporaryDirectory(prefix="planner-bench-") as tmp:
        logs = args.log_dir or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        for repeat in range(args.repeats):
            # Round robin, so that the VM's slow spells fall on every configuration alike.
            for name, extra in chosen:
                label = name if args.repeats == 1 else f"{name} #{repeat + 1}"
                runs[name].append(run_config(label, extra, plan, args, logs, console))
    records = [median_record(name, rs) for name, rs in runs.items()]
    medians = f", medians of {args.repeats} repeats" if args.repeats > 1 else ""
    table = Table(title=f"Goodput (req/s within SLO), {args.max_workers} workers at most{medians}")
    for col in ("config", *(f"{ph} goodput" for ph in PHASES), "mean", *(f"{ph} TTFT p90 s" for ph in PHASES),
                *(f"{ph} ITL p90 s" for ph in PHASES), "completed"):
        table.add_column(col, justify="right")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for r in records:
        table.add_row(r.config, *(fmt(r.goodput[ph]) for ph in PHASES), fmt(r.total_goodput),
                      *(fmt(r.ttft_p90_s[ph]) for ph in PHASES), *(fmt(r.itl_p90_s[ph]) for ph in PHASES),
                      " / ".join(f"{r.completed[ph]}/{r.arrived[ph]}" for ph in PHASES))
    console.print(table)
    by = {r.config: r for r in records}
    planner = by.get("planner")
    statics = [r for r in records if r.config.startswith("static")]
    vs_best, vs_each = {}, {}
    if planner is not None and statics:
        for ph in PHASES:
            best = max(s.goodput[ph] for s in statics)
            vs_best[ph] = planner.goodput[ph] / best if best else None
        vs_each = {s.config: (planner.total_goodput / s.total_goodput if s.total_goodput else None) for s in statics}
        console.print(f"planner ÷ best static split per phase: {vs_best} (target ≥ 0.9); whole run ÷ each static "
                      f"split: {vs_each} (target > 1)" + (f"; medians of {args.repeats} repeats" if args.repeats > 1
                                                         else ""))
        for line in runs["planner"][-1].decisions:
            console.print(f"  {line[:190]}")
    write_report(args.out, {
        "benchmark": "planner", "records": [{**asdict(r), "total_goodput": r.total_goodput} for r in records],
        "goodput_vs_best_static": vs_best, "planner_vs_each_static_whole_run": vs_each,
        "repeats": args.repeats,
        "runs": {name: [{**asdict(r), "total_goodput": r.total_goodput} for r in rs] for name, rs in runs.items()},
        "workload": {k: getattr(args, k) for k in ("phase_s", "a_rate", "a_prompt", "a_output", "b_rate",
                                                    "b_prompt", "b_output", "ttft_ms", "itl_ms", "max_workers",
                                                    "interval_s", "cooldown_s", "seed")},
        "num_requests": len(plan),
    })
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
