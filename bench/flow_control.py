"""Flow control under a flood (issue 40): a steady tenant's TTFT alone, and beside a tenant that
floods at 5x capacity, on one `splitserve serve --flow-control`.

    python bench/flow_control.py --rounds 3 --out bench/results/flow_control.json   # minutes: a quiet machine
    python bench/flow_control.py --quick                                            # a smoke run

One server, started once: `serve --aggregated` (one worker) with `--flow-control --max-concurrency
C --priority-band 0 --max-queue Q`, so that the room is C requests in flight and a band holds Q.
On a machine of 2 cores or more `--reserved-cores 1` keeps the first core free of the worker, and
this process (the clients) is pinned to that core: the flood's client and the frontend's 429s
share a core with each other, not with the model.

1. Capacity (unless `--capacity-rps` gives it): a closed loop of C concurrent clients, each
   request as below, for `--capacity-requests` requests: completed requests per second.
2. Each round, both phases over the same seeded arrival schedule of tenant B (Poisson arrivals at
   `--steady-load` x capacity, default 0.5, for `--duration` s), their order alternating between
   rounds, the server idle before each (nothing queued or running):
   - alone: tenant B only;
   - flood: tenant B, and tenant A's Poisson arrivals at `--flood-load` x capacity (default 5).
   Every request is `/v1/completions` streamed, `--prompt-tokens` random token ids (the same in
   both phases, with a `cache_salt` per phase so that the second phase of a round does not find
   the first's prompts in the prefix cache),
   `--output-tokens` generated (EOS ignored), each tenant named by x-llm-d-inference-fairness-id.

Per round: B's TTFT p50/p90 in each phase and `steady_ttft_p90_vs_alone` = flood ÷ alone (target
<= 1.5); B's errors (anything but a whole 200 answer, time-outs included: `steady_errors`, target
0 over all rounds and both phases); A's requests served and shed, and the p90 of the time from
sending a shed request to its 429 (`flood_shed_p90_ms`, target <= 100); the machine's busy cores and
load average during each phase. The JSON (`--out`) holds the commit, the CPU model, the server's
flags, every round and the min / median / max of each figure over the rounds; the headline
figures are the medians (steady_errors: the sum).
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
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

from bench_support import machine_jiffies, stop_group, wait_ready
from splitserve.hardware import write_report
from splitserve.net import free_port
from splitserve.testing.metrics import sample_sum

ROOT = Path(__file__).resolve().parents[1]
FAIRNESS = "x-llm-d-inference-fairness-id"
DROPPED = "x-llm-d-request-dropped-reason"
REQUEST_TIMEOUT_S = 300.0
TARGETS = {"steady_ttft_p90_vs_alone": 1.5, "steady_errors": 0, "flood_shed_p90_ms": 100.0}


@dataclass(slots=True)
class Outcome:
    """One request: when it went, its first token (None: none), and how it ended."""

    sent: float
    first_token: float | None = None
    ended: float | None = None
    status: int = 0                   # 0: no answer (a time-out, a broken connection)
    reason: str = ""                  # x-llm-d-request-dropped-reason of a 429
    num_tokens: int = 0
    error: str = ""


@dataclass(slots=True)
class Phase:
    name: str
    steady: list[Outcome] = field(default_factory=list)
    flood: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    busy_cores: float = 0.0
    loadavg_1m: float = 0.0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


# -- one request ---------------------------------------------------------------------------------
async def stream(http: aiohttp.ClientSession, base: str, body: dict, tenant: str, expect_tokens: int) -> Outcome:
    out = Outcome(time.perf_counter())
    try:
        async with http.post(f"{base}/v1/completions", json=body, headers={FAIRNESS: tenant}) as reply:
            out.status = reply.status
            if reply.status != 200:
                out.reason = reply.headers.get(DROPPED, "")
                out.error = "" if reply.status == 429 else (await reply.text())[:200]
                await reply.read()
                return out
            async for raw in reply.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = chunk["error"]["message"][:200]
                    continue
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    out.first_token = out.first_token or time.perf_counter()
                if chunk.get("usage"):                 # the last chunk (include_usage)
                    out.num_tokens = chunk["usage"]["completion_tokens"]
        if out.num_tokens != expect_tokens and not out.error:
            out.error = f"{out.num_tokens} of {expect_tokens} tokens"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        out.ended = time.perf_counter()
    return out


def request_body(model: str, prompt: list[int], args, cache_salt: str = "") -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": args.output_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if cache_salt:
        body["cache_salt"] = cache_salt
    return body


def steady_ok(o: Outcome, args) -> bool:
    return o.status == 200 and not o.error and o.num_tokens == args.output_tokens


# -- load --------------------------------------------------------------------------------------------
async def open_loop(http, base: str, model: str, rate: float, duration: float, tenant: str, seed: int,
                    args, cache_salt: str) -> list[Outcome]:
    """Poisson arrivals at `rate`/s for `duration` s (seeded: the same schedule and prompts every
    phase; `cache_salt` per phase, so that no phase finds the other's prompts in the prefix cache)."""
    rng = random.Random(seed)
    start, at, tasks = time.perf_counter(), 0.0, []
    while True:
        at += rng.expovariate(rate)
        if at >= duration:
            break
        prompt = [rng.randrange(5, 32000) for _ in range(args.prompt_tokens)]
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        tasks.append(asyncio.create_task(stream(http, base, request_body(model, prompt, args, cache_salt), tenant,
                                                args.output_tokens)))
    return list(await asyncio.gather(*tasks))


async def measure_capacity(http, base: str, model: str, args) -> float:
    """Completed requests per second of a closed loop of --max-concurrency clients."""
    rng = random.Random(args.seed + 7)
    prompts = [[rng.randrange(5, 32000) for _ in range(args.prompt_tokens)] for _ in range(args.capacity_requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    done: list[Outcome] = []

    async def client() -> None:
        while not queue.empty():
            done.append(await stream(http, base, request_body(model, queue.get_nowait(), args), "probe",
                                     args.output_tokens))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.max_concurrency)))
    failed = [o for o in done if not steady_ok(o, args)]
    if failed:
        raise SystemExit(f"capacity probe: {len(failed)} requests failed, e.g. {failed[0]}")
    return len(done) / (time.perf_counter() - start)


async def wait_idle(http, base: str, timeout: float = 120.0) -> None:
    """Until the frontend has nothing queued or running (the previous phase's tail is gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        async with http.get(f"{base}/metrics") as reply:
            text = await reply.text()
        if sample_sum(text, "splitserve_flow_control_queued_requests") == 0 and \
                sample_sum(text, "splitserve_requests_in_flight") == 0:
            return
        await asyncio.sleep(0.2)
    raise SystemExit("the server did not go idle between phases")


async def run_phase(http, base: str, model: str, name: str, capacity: float, round_: int, args) -> Phase:
    await wait_idle(http, base)
    phase = Phase(name, loadavg_1m=float(Path("/proc/loadavg").read_text().split()[0]))
    busy0, total0 = machine_jiffies()
    start = time.perf_counter()
    steady_seed = args.seed + 1000 * round_
    salt = f"{name}-{round_}"
    steady = open_loop(http, base, model, args.steady_load * capacity, args.duration, "tenant-b", steady_seed, args,
                       salt)
    if name == "flood":
        phase.steady, phase.flood = await asyncio.gather(steady, open_loop(
            http, base, model, args.flood_load * capacity, args.duration, "tenant-a", steady_seed + 1, args, salt))
    else:
        phase.steady = await steady
    phase.wall_s = time.perf_counter() - start
    busy1, total1 = machine_jiffies()
    phase.busy_cores = (busy1 - busy0) / max(total1 - total0, 1) * (os.cpu_count() or 1)
    return phase


def summarize(round_: int, alone: Phase, flood: Phase, args) -> dict:
    ttft = {p.name: [1e3 * (o.first_token - o.sent) for o in p.steady if steady_ok(o, args)] for p in (alone, flood)}
    shed = [o for o in flood.flood if o.status == 429]
    p90_alone, p90_flood = percentile(ttft["alone"], 90), percentile(ttft["flood"], 90)
    return {
        "round": round_,
        "steady_requests": {p.name: len(p.steady) for p in (alone, flood)},
        "steady_errors": sum(not steady_ok(o, args) for p in (alone, flood) for o in p.steady),
        "steady_error_examples": [o.error or f"status {o.status}" for p in (alone, flood) for o in p.steady
                                  if not steady_ok(o, args)][:5],
        "steady_ttft_p50_ms": {p: percentile(v, 50) for p, v in ttft.items()},
        "steady_ttft_p90_ms": {"alone": p90_alone, "flood": p90_flood},
        "steady_ttft_p90_vs_alone": None if not p90_alone or p90_flood is None else p90_flood / p90_alone,
        "flood_requests": len(flood.flood),
        "flood_served": sum(steady_ok(o, args) for o in flood.flood),
        "flood_shed": len(shed),
        "flood_shed_reasons": {r: sum(o.reason == r for o in shed) for r in sorted({o.reason for o in shed})},
        "flood_other": sum(o.status != 429 and not steady_ok(o, args) for o in flood.flood),
        "flood_shed_p50_ms": percentile([1e3 * (o.ended - o.sent) for o in shed], 50),
        "flood_shed_p90_ms": percentile([1e3 * (o.ended - o.sent) for o in shed], 90),
        "busy_cores": {p.name: round(p.busy_cores, 2) for p in (alone, flood)},
        "loadavg_1m": {p.name: p.loadavg_1m for p in (alone, flood)},
    }


# -- the server ------------------------------------------------------------------------------------
def server_argv(args, port: int) -> list[str]:
    argv = [sys.executable, "-m", "splitserve", "serve", "--aggregated", "--model", args.model, "--port", str(port),
            "--grpc-port", "0", "--flow-control", "--max-concurrency", str(args.max_concurrency),
            "--priority-band", "0", "--max-queue", str(args.max_queue)]
    if args.reserved_cores:
        argv += ["--reserved-cores", str(args.reserved_cores)]
    return argv


async def bench(base: str, args, console: Console) -> tuple[float, list[dict]]:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        async with http.get(f"{base}/v1/models") as reply:
            model = (await reply.json())["data"][0]["id"]
        await stream(http, base, request_body(model, list(range(100, 100 + args.prompt_tokens)), args), "warm",
                     args.output_tokens)
        capacity = args.capacity_rps or await measure_capacity(http, base, model, args)
        console.print(f"capacity: {capacity:.2f} requests/s at {args.max_concurrency} in flight; tenant B at "
                      f"{args.steady_load * capacity:.2f}/s, tenant A at {args.flood_load * capacity:.2f}/s")
        rounds = []
        for round_ in range(1, args.rounds + 1):
            order = ("alone", "flood") if round_ % 2 else ("flood", "alone")
            phases = {name: await run_phase(http, base, model, name, capacity, round_, args) for name in order}
            row = summarize(round_, phases["alone"], phases["flood"], args)
            console.print(f"round {round_}: B TTFT p90 alone {_ms(row['steady_ttft_p90_ms']['alone'])} ms, flood "
                          f"{_ms(row['steady_ttft_p90_ms']['flood'])} ms; B errors {row['steady_errors']}; A shed "
                          f"{row['flood_shed']} of {row['flood_requests']}, p90 {_ms(row['flood_shed_p90_ms'])} ms")
            rounds.append(row)
        await wait_idle(http, base)
    return capacity, rounds


def spread(values: list) -> dict | None:
    have = [v for v in values if v is not None]
    if not have:
        return None
    return {"min": min(have), "median": statistics.median(have), "max": max(have), "n": len(have)}


def _ms(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def print_table(console: Console, rounds: list[dict]) -> None:
    t = Table(title="flow control: tenant B steady, tenant A flooding (each round both phases, same B schedule)")
    for col in ("round", "B TTFT p90 alone ms", "B TTFT p90 flood ms", "ratio (<= 1.5)", "B errors (0)",
                "A served", "A shed", "A shed p90 ms (<= 100)", "busy cores alone/flood"):
        t.add_column(col, justify="right")
    for r in rounds:
        ratio = r["steady_ttft_p90_vs_alone"]
        t.add_row(str(r["round"]), _ms(r["steady_ttft_p90_ms"]["alone"]), _ms(r["steady_ttft_p90_ms"]["flood"]),
                  "-" if ratio is None else f"{ratio:.2f}", str(r["steady_errors"]), str(r["flood_served"]),
                  str(r["flood_shed"]), _ms(r["flood_shed_p90_ms"]),
                  f"{r['busy_cores']['alone']:.2f} / {r['busy_cores']['flood']:.2f}")
    console.print(t)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="serve's --model (default: %(default)s)")
    p.add_argument("--max-concurrency", type=int, default=4, help="the server's room (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=16, help="the band's queue (default: %(default)s)")
    p.add_argument("--capacity-rps", type=float, default=None, help="skip the probe: capacity in requests/s")
    p.add_argument("--capacity-requests", type=int, default=24, help="requests of the probe (default: %(default)s)")
    p.add_argument("--steady-load", type=float, default=0.5, help="tenant B, × capacity (default: %(default)s)")
    p.add_argument("--flood-load", type=float, default=5.0, help="tenant A, × capacity (default: %(default)s)")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per phase (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reserved-cores", type=int, default=1 if (os.cpu_count() or 1) >= 2 else 0,
                   help="serve's --reserved-cores; this process is pinned to them (default: %(default)s)")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--quick", action="store_true", help="a smoke run: 8 s phases, a short probe, one round")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "flow_control.json")
    args = p.parse_args(argv)
    if args.quick:
        args.duration, args.capacity_requests, args.rounds = 8.0, 8, 1
    console = Console(width=160)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"flow_control-serve-{port}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(server_argv(args, port), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if args.reserved_cores:     # after the start: serve shares out the cores it inherits
            os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.reserved_cores])
        try:
            wait_ready(f"{base}/v1/models", proc, args.ready_timeout)
            capacity, rounds = asyncio.run(bench(base, args, console))
        finally:
            stop_group(proc, 30)
    print_table(console, rounds)
    ratios = spread([r["steady_ttft_p90_vs_alone"] for r in rounds])
    shed_p90 = spread([r["flood_shed_p90_ms"] for r in rounds])
    headline = {"steady_ttft_p90_vs_alone": ratios and ratios["median"],
                "steady_errors": sum(r["steady_errors"] for r in rounds),
                "flood_shed_p90_ms": shed_p90 and shed_p90["median"]}
    met = {k: None if v is None else (v <= TARGETS[k]) for k, v in headline.items()}
    console.print(f"headline (medians over {len(rounds)} round(s); errors summed): {headline}; targets met: {met}")
    write_report(args.out, {"benchmark": "flow_control", **headline, "targets": TARGETS, "met": met,
                            "capacity_rps": capacity, "server": server_argv(args, 0)[2:],
                            "workload": {k: getattr(args, k) for k in ("steady_load", "flood_load", "duration",
                                                                       "prompt_tokens", "output_tokens", "seed")},
                            "machine": {"cores": os.cpu_count(), "client_cores": sorted(os.sched_getaffinity(0)),
                                        "loadavg_at_end": Path("/proc/loadavg").read_text().split()[:3]},
                            "over_rounds": {"steady_ttft_p90_vs_alone": ratios, "flood_shed_p90_ms": shed_p90,
                                            "steady_ttft_p90_alone_ms": spread(
                                                [r["steady_ttft_p90_ms"]["alone"] for r in rounds]),
                                            "steady_ttft_p90_flood_ms": spread(
                                                [r["steady_ttft_p90_ms"]["flood"] for r in rounds])},
                            "rounds": rounds, "server_log": str(log_path)})
    console.print(f"wrote {args.out} (server log: {log_path})")


if __name__ == "__main__":
    main()
