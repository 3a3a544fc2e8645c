"""Serving benchmark: disaggregated (1 prefill + 1 decode worker) vs aggregated (2 workers),
and the frontend's added latency.

    python bench/serving.py [--model DIR] [--transfer auto|nixl|tcp] [--only all|workload|overhead]
                            [--overhead-requests N] [--profile-frontend FILE] [--out FILE]

One run on this machine, loopback only. Each deployment is real processes: the
workers pinned to separate cores (`taskset`: core 0, core 1, ...; one torch
thread each) and the frontend on the next core when the machine has one left,
else unpinned (on 2 cores the workload deployments leave it unpinned). The same
mixed workload runs against the HTTP endpoint with streaming:

- decode-heavy requests (short prompts, long outputs) start first and keep decoding;
- long prompts arrive at a fixed interval while those decode (the interference that
  disaggregation removes: an aggregated worker stalls its decodes for each prefill);
- the long prompts come often enough that an aggregated worker's stalls are about 2%
  of its inter-token gaps (each prefill stalls one gap of every sequence decoding on
  that worker): p99 must lie among them to measure the interference at all. With
  stalls near 1% (the earlier 6 prompts of 1536 tokens every 0.5 s: 0.95%) the
  aggregated p99 was either a stall (~250 ms) or a plain step (~20 ms), run to run;
- once every long prompt has its output, the client stops the decodes (they would run
  up to decode_output_tokens), so every inter-token gap measured lies in the window
  where prefills arrive, however fast the engine decodes. (With a fixed 160-token
  output, a faster engine finished its decodes before most long prompts came, and
  the few stalled gaps fell below the p99.)

Reported per deployment: TTFT p50/p99, inter-token latency p50/p99 (gap between
streamed tokens of one request), output tokens/s over the workload's wall time;
the JSON adds ITL p90, p99.9 and max, and the share of gaps over 3x the
deployment's ITL p50 (the stalls).

Frontend overhead: a deployment of its own, one aggregated worker on core 0 and
the frontend alone on core 1. The same request (16 prompt token ids, 4 greedy
output tokens, EOS ignored; the script checks both paths return the same ids) is
sent sequentially four ways, in rotating order: straight to the worker's gRPC
Generate, straight to the worker's session stream (the frontend's own link code,
services/frontend/workers/session.py, in this process), through the HTTP frontend
streamed (SSE), and through it not streamed. Overhead = p50(HTTP) - p50(gRPC
direct), the issue's definition; the target is on the streamed path, the
whole-response path is reported beside it. The frontend reaches the worker over
the session stream, which skips grpc's thread hops on both sides, so the HTTP
path can come out as the direct gRPC call; p50(HTTP) - p50(stream
direct) is therefore reported too: what the frontend's own work (HTTP, parsing,
routing, relaying) adds over the same worker transport. Also reported: the paired median of
(HTTP - gRPC) and the frontend process's CPU time per HTTP request (all its
threads, from /proc/PID/task/*/schedstat): the wall-clock difference absorbs
every preemption on a shared machine, the CPU time does not, so it says what the
frontend itself costs; the benchmark's own CPU per request (aiohttp vs grpc.aio,
client side) is reported too, since the HTTP path's client is part of the
difference. The HTTP client is aiohttp: httpx, which the load generator uses,
spends about a millisecond more of client CPU per request on this machine,
and that would land in the difference although the frontend does not cost it.
`--profile-frontend FILE` runs that frontend under cProfile (its numbers are
then inflated) and writes the stats to FILE.

Model: the random-weight h256 Llama test checkpoint (splitserve.testing.models) unless
--model names a folder. Targets: disaggregated ITL p99 <= 0.5x aggregated; frontend
overhead <= 1 ms p50.
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
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import grpc
import httpx

from splitserve.net import free_port
from splitserve.proto.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from splitserve.services.frontend.workers.session import WorkerSession

ROOT = Path(__file__).resolve().parent


@dataclass
class Workload:
    num_decode_requests: int = 8
    decode_prompt_tokens: int = 64
    decode_output_tokens: int = 3000        # an upper bound: stopped after the last long prompt
    # Enough prefills that their stalls are well over 1% of an aggregated worker's gaps, so the
    # p99 sees them every run (6 prompts of 1536 tokens at 0.5 s made 0.95%: p99 fell either side).
    num_long_prompts: int = 16
    long_prompt_tokens: int = 768
    long_output_tokens: int = 16
    long_interval_s: float = 0.2
    overhead_requests: int = 200


@dataclass
class RequestTrace:
    kind: str
    start: float
    token_times: list[float] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def pinned(core: int | None) -> list[str]:
    return [] if core is None else ["taskset", "-c", str(core)]


class Deployment:
    """Pinned workers and a frontend, as separate processes.

    Worker i runs on core i; the frontend gets core len(roles) when the machine
    has it, else it is left unpinned. `frontend_prefix` goes before the
    frontend's `-m splitserve` (e.g. `-m cProfile -o FILE`).
    """

    def __init__(self, model: str, roles: list[str], transfer: str, threshold: int, logdir: Path,
                 frontend_prefix: list[str] | None = None):
        self.procs: list[subprocess.Popen] = []
        self.workers: list[tuple[str, str]] = []
        num_cpus = os.cpu_count() or 1
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for core, role in enumerate(roles):
            port = free_port()
            name = f"{role}-{core}"
            argv = [*pinned(core % num_cpus), sys.executable, "-m", "splitserve", "worker", "--role", role,
                    "--model", model, "--port", str(port), "--worker-id", name, "--threads", "1",
                    "--kv-cache-gib", "0.25", "--transfer", transfer,
                    "--remote-prefill-threshold", str(threshold)]
            self.procs.append(subprocess.Popen(argv, env=env, stdout=open(logdir / f"{name}.log", "w"),
                                               stderr=subprocess.STDOUT))
            self.workers.append((role, f"127.0.0.1:{port}"))
        self.frontend_core = len(roles) if len(roles) < num_cpus else None
        self.port = free_port()
        argv = [*pinned(self.frontend_core), sys.executable, *(frontend_prefix or []), "-m", "splitserve",
                "frontend", "--model", model, "--port", str(self.port)]
        for role, address in self.workers:
            argv += ["--worker", f"{role}={address}"]
        self.frontend = subprocess.Popen(argv, env=env, stdout=open(logdir / "frontend.log", "w"),
                                         stderr=subprocess.STDOUT)
        self.procs.append(self.frontend)
        self.base = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                reply = httpx.get(f"{self.base}/ready", timeout=1)
                if reply.status_code == 200 and reply.json().get("all_workers_ready"):
                    return
            except httpx.HTTPError:
                pass
            if any(p.poll() is not None for p in self.procs):
                raise SystemExit("a process exited during startup (see the logs)")
            time.sleep(0.2)
        raise SystemExit("not ready in time")

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


async def stream_request(http: httpx.AsyncClient, base: str, model: str, prompt: list[int], max_tokens: int,
                         kind: str) -> RequestTrace:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True}
    trace = RequestTrace(kind, time.perf_counter())
    try:
        async with http.stream("POST", f"{base}/v1/completions", json=body) as reply:
            reply.raise_for_status()
            async for line in reply.aiter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    chunk = json.loads(line[5:])
                    if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                        trace.token_times.append(time.perf_counter())
    except asyncio.CancelledError:
        if kind != "decode":
            raise               # only the decodes are stopped on purpose (run_workload)
    return trace


async def run_workload(base: str, w: Workload, seed: int) -> dict:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        model = (await http.get(f"{base}/v1/models")).json()["data"][0]["id"]
        start = time.perf_counter()
        tasks = [asyncio.create_task(stream_request(
            http, base, model, [rng.randrange(5, 32000) for _ in range(w.decode_prompt_tokens)],
            w.decode_output_tokens, "decode")) for _ in range(w.num_decode_requests)]
        await asyncio.sleep(0.5)              # the decodes are running when the long prompts arrive
        longs = []
        for _ in range(w.num_long_prompts):
            longs.append(asyncio.create_task(stream_request(
                http, base, model, [rng.randrange(5, 32000) for _ in range(w.long_prompt_tokens)],
                w.long_output_tokens, "long")))
            await asyncio.sleep(w.long_interval_s)
        traces = await asyncio.gather(*longs)
        wall = time.perf_counter() - start
        for task in tasks:
            task.cancel()
        traces += await asyncio.gather(*tasks)
        if any(not t.token_times for t in traces):
            raise SystemExit("a request produced no token (see the deployment's logs)")
    ttft = [t.token_times[0] - t.start for t in traces if t.token_times]
    itl = [b - a for t in traces for a, b in zip(t.token_times, t.token_times[1:])]
    tokens = sum(len(t.token_times) for t in traces)
    itl_p50 = percentile(itl, 50)
    return {"ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "itl_p50_ms": 1e3 * itl_p50, "itl_p90_ms": 1e3 * percentile(itl, 90),
            "itl_p99_ms": 1e3 * percentile(itl, 99), "itl_p99_9_ms": 1e3 * percentile(itl, 99.9),
            "itl_max_ms": 1e3 * max(itl), "num_gaps": len(itl),
            "stalled_gap_share": sum(g > 3 * itl_p50 for g in itl) / len(itl),
            "output_tokens_per_s": tokens / wall, "num_requests": len(traces), "num_output_tokens": tokens,
            "wall_s": wall}


def cpu_ns(pid: int) -> int:
    """CPU time a process has used so far, all its threads, in ns (schedstat's first field)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass            # a thread that ended meanwhile
    return total


OVERHEAD_PROMPT = list(range(1000, 1016))
OVERHEAD_OUTPUT_TOKENS = 4
PATHS = ("grpc_direct", "stream_direct", "http_stream", "http_whole")
HTTP_PATHS = PATHS[2:]


async def frontend_overhead(d: Deployment, w: Workload) -> dict:
    """The same short request, sequentially: the worker's gRPC Generate vs the HTTP frontend
    streamed and not (one worker, so both paths reach the same engine)."""
    worker = d.workers[0][1]
    wall: dict[str, list[float]] = {p: [] for p in PATHS}
    cpu: dict[str, list[float]] = {p: [] for p in HTTP_PATHS}       # the frontend's
    client_cpu: dict[str, list[float]] = {p: [] for p in PATHS}     # this process's
    async with aiohttp.ClientSession() as http, grpc.aio.insecure_channel(worker) as channel:
        async with http.get(f"{d.base}/v1/models") as reply:
            model = (await reply.json())["data"][0]["id"]
        stub = worker_pb2_grpc.WorkerStub(channel)
        session_port = (await stub.Describe(worker_pb2.DescribeRequest())).session_port
        session = WorkerSession.over_stream(worker.rpartition(":")[0], session_port, None, None, worker)
        stream_body, whole_body = (json.dumps(overhead_body(model, stream)).encode() for stream in (True, False))
        headers = {"content-type": "application/json"}

        async def grpc_direct(i: int) -> None:
            async for _ in stub.Generate(overhead_grpc_request(f"direct-{i}")):
                pass

        async def stream_direct(i: int) -> None:
            async for _ in session.generate(overhead_grpc_request(f"stream-{i}")):
                pass

        async def http_stream(i: int) -> None:
            async with http.post(f"{d.base}/v1/completions", data=stream_body, headers=headers) as reply:
                reply.raise_for_status()
                async for _ in reply.content.iter_any():
                    pass

        async def http_whole(i: int) -> None:
            async with http.post(f"{d.base}/v1/completions", data=whole_body, headers=headers) as reply:
                reply.raise_for_status()
                await reply.read()

        await check_same_tokens(http, stub, d.base, model)
        calls = {"grpc_direct": grpc_direct, "stream_direct": stream_direct, "http_stream": http_stream,
                 "http_whole": http_whole}
        for i in range(w.overhead_requests + 5):          # the first 5 rounds warm up
            for path in PATHS[i % 4:] + PATHS[:i % 4]:     # rotate which goes first
                c, own, t = cpu_ns(d.frontend.pid), time.process_time(), time.perf_counter()
                await calls[path](i)
                t, own, c = time.perf_counter() - t, time.process_time() - own, cpu_ns(d.frontend.pid) - c
                if i >= 5:
                    wall[path].append(t)
                    client_cpu[path].append(own)
                    if path in cpu:
                        cpu[path].append(c / 1e9)
        await session.close()
    g, s = statistics.median(wall["grpc_direct"]), statistics.median(wall["stream_direct"])
    out = {"grpc_direct_p50_ms": 1e3 * g, "stream_direct_p50_ms": 1e3 * s, "num_requests": len(wall["grpc_direct"]),
           "grpc_direct_client_cpu_p50_ms": 1e3 * statistics.median(client_cpu["grpc_direct"]),
           "prompt_tokens": len(OVERHEAD_PROMPT), "output_tokens": OVERHEAD_OUTPUT_TOKENS,
           "frontend_core": d.frontend_core, "http_client": f"aiohttp {aiohttp.__version__}"}
    for path in HTTP_PATHS:
        h = statistics.median(wall[path])
        out[path] = {"http_p50_ms": 1e3 * h, "overhead_p50_ms": 1e3 * (h - g),
                     "over_stream_direct_p50_ms": 1e3 * (h - s),
                     "paired_overhead_p50_ms": 1e3 * statistics.median(
                         a - b for a, b in zip(wall[path], wall["grpc_direct"])),
                     "frontend_cpu_p50_ms": 1e3 * statistics.median(cpu[path]),
                     "client_cpu_p50_ms": 1e3 * statistics.median(client_cpu[path])}
    return out


def overhead_body(model: str, stream: bool, token_ids: bool = False) -> dict:
    return {"model": model, "prompt": OVERHEAD_PROMPT, "max_tokens": OVERHEAD_OUTPUT_TOKENS, "stream": stream,
            "temperature": 0, "ignore_eos": True, "return_token_ids": token_ids}


def overhead_grpc_request(request_id: str) -> worker_pb2.TokenGenerateRequest:
    return worker_pb2.TokenGenerateRequest(
        request_id=request_id, token_ids=OVERHEAD_PROMPT,
        params=common_pb2.SamplingParams(max_tokens=OVERHEAD_OUTPUT_TOKENS, temperature=0, ignore_eos=True))


async def check_same_tokens(http: aiohttp.ClientSession, stub, base: str, model: str) -> None:
    """Both paths must generate the same tokens, or the comparison means nothing."""
    async with http.post(f"{base}/v1/completions", json=overhead_body(model, False, token_ids=True)) as reply:
        via_http = (await reply.json())["choices"][0]["token_ids"]
    via_grpc = []
    async for resp in stub.Generate(overhead_grpc_request("direct-check")):
        via_grpc.extend(resp.token_ids)
    if via_http != via_grpc or len(via_grpc) != OVERHEAD_OUTPUT_TOKENS:
        raise SystemExit(f"the paths disagree: HTTP {via_http} vs gRPC {via_grpc}")


def print_table(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    if "itl_p99_ratio" in results:
        table = Table(title=f"splitserve serving benchmark ({results['model']}, transfer {results['transfer']})")
        for col in ("deployment", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "ITL max ms",
                    "stalled gaps", "output tok/s"):
            table.add_column(col, justify="right")
        for name in ("disaggregated_1p1d", "aggregated_2x"):
            r = results[name]
            table.add_row(name, f"{r['ttft_p50_ms']:.1f}", f"{r['ttft_p99_ms']:.1f}", f"{r['itl_p50_ms']:.2f}",
                          f"{r['itl_p99_ms']:.2f}", f"{r['itl_max_ms']:.1f}", f"{100 * r['stalled_gap_share']:.2f}%",
                          f"{r['output_tokens_per_s']:.1f}")
        console.print(table)
        ratio = results["itl_p99_ratio"]
        console.print(f"ITL p99 disaggregated / aggregated = {ratio:.2f} (target <= 0.5: "
                      f"{'met' if ratio <= 0.5 else 'NOT met'})")
    o = results.get("frontend_overhead")
    if o is not None:
        where = "unpinned" if o["frontend_core"] is None else f"pinned to core {o['frontend_core']}"
        console.print(f"frontend overhead ({o['num_requests']} sequential requests, {o['prompt_tokens']} prompt "
                      f"-> {o['output_tokens']} output tokens, frontend {where}); gRPC direct p50 "
                      f"{o['grpc_direct_p50_ms']:.2f} ms, client CPU {o['grpc_direct_client_cpu_p50_ms']:.2f} ms; "
                      f"session stream direct p50 {o['stream_direct_p50_ms']:.2f} ms")
        for path in HTTP_PATHS:
            r = o[path]
            target = (f" (target <= 1 ms: {'met' if r['overhead_p50_ms'] <= 1.0 else 'NOT met'})"
                      if path == "http_stream" else "")
            console.print(f"  {path}: HTTP p50 {r['http_p50_ms']:.2f} ms, overhead p50 {r['overhead_p50_ms']:.2f} ms"
                          f"{target}, paired {r['paired_overhead_p50_ms']:.2f} ms, over the stream direct "
                          f"{r['over_stream_direct_p50_ms']:.2f} ms, frontend CPU "
                          f"{r['frontend_cpu_p50_ms']:.2f} ms/request, client CPU {r['client_cpu_p50_ms']:.2f} ms")
    console.print(f"load average before / after: {results['load_before']} / {results['load_after']}")


def run_deployment(name: str, roles: list[str], args, model: str, transfer: str, threshold: int, tmp: Path,
                   work) -> dict:
    print(f"running {name}...", file=sys.stderr, flush=True)
    prefix = None
    if name == "overhead_1x" and args.profile_frontend is not None:
        prefix = ["-m", "cProfile", "-o", str(args.profile_frontend.resolve())]
    d = Deployment(model, roles, transfer, threshold, tmp, prefix)
    try:
        d.wait_ready()
        return asyncio.run(work(d))
    finally:
        d.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: a random h256 Llama)")
    parser.add_argument("--transfer", default="auto", choices=["auto", "nixl", "tcp"])
    parser.add_argument("--only", default="all", choices=["all", "workload", "overhead"],
                        help="run only the mixed workload, or only the frontend overhead (default: both)")
    parser.add_argument("--overhead-requests", type=int, default=Workload.overhead_requests,
                        help="timed requests per path in the overhead part (default: %(default)s)")
    parser.add_argument("--profile-frontend", type=Path, default=None, metavar="FILE",
                        help="run the overhead part's frontend under cProfile, stats to FILE")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON report (default: bench/results/serving.json, or serving-ONLY.json)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = args.out or ROOT / "results" / ("serving.json" if args.only == "all" else f"serving-{args.only}.json")
    w = Workload(overhead_requests=args.overhead_requests)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = args.model
        if model is None:
            from splitserve.testing.models import build_random_model
            model = str(build_random_model("llama", tmp / "llama-h256", seed=0))
        from splitserve.services.engine.rank_connectors import resolve_backend
        transfer = resolve_backend(args.transfer)
        results = {"model": "random h256 Llama (4 layers)" if args.model is None else model,
                   "transfer": transfer, "workload": asdict(w), "cpus": os.cpu_count(),
                   "load_before": [round(x, 2) for x in os.getloadavg()]}
        threshold = w.decode_prompt_tokens * 2      # short prompts prefill locally, long ones remotely
        if args.only in ("all", "workload"):
            for name, roles in (("disaggregated_1p1d", ["prefill", "decode"]), ("aggregated_2x", ["both", "both"])):
                results[name] = run_deployment(name, roles, args, model, transfer, threshold, tmp,
                                               lambda d: run_workload(d.base, w, args.seed))
            results["itl_p99_ratio"] = (results["disaggregated_1p1d"]["itl_p99_ms"]
                                        / results["aggregated_2x"]["itl_p99_ms"])
        if args.only in ("all", "overhead"):
            results["frontend_overhead"] = run_deployment("overhead_1x", ["both"], args, model, transfer,
                                                          threshold, tmp, lambda d: frontend_overhead(d, w))
        results["load_after"] = [round(x, 2) for x in os.getloadavg()]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
