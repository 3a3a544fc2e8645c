"""KV tiers on the Mooncake conversation trace: device only vs device+host vs device+host+disk vs
device+host+store.

Each configuration is one `splitserve serve --aggregated --workers 2` (the kv router, one worker
pinned to each core) replaying the same slice of the Mooncake FAST'25 conversation trace
(`splitserve bench --workload trace --arrival trace`, prompts sent as token ids so that the
trace's 512-token blocks map onto KV blocks exactly). Scaled to these machines:

- a trace block of 512 tokens becomes `--block-tokens` tokens (default 4), and the engine's
  block size is set to the same, so a shared trace block is a shared KV block;
- output lengths scale by the same factor (capped at 32 tokens);
- time: the trace's own timestamps times `--time-scale`;
- memory: each worker's device pool (`--device-gib`) holds a small share of the slice's
  working set (printed: unique blocks × bytes per block); the host and disk tiers
  (`--host-gib`, `--disk-gib` per worker) and the shared store (`--store-gib`, one for both
  workers, started by `serve --kv-store-gib`) hold much more.

Per configuration: prompt tokens computed and served from cache, the prefix hit rate split by
where the hit came from (device pool, host tier, disk tier, shared store; from the workers'
Stats), TTFT p50/p90 (from the client).

    python bench/kv_tiers.py --out bench/results/kv_tiers.json            # ~15 min on 2 cores
    python bench/kv_tiers.py --requests 60 --configs device,host          # a quick look

The JSON has one record per configuration and, at the top, `hit_rate_ratio` and
`ttft_p90_ratio` (all tiers ÷ device only).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from rich.console import Console
from rich.table import Table

from bench_support import stop_group, wait_ready
from splitserve.hardware import write_report
from splitserve.net import free_port
from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("device", "host", "disk", "store")
SMOLLM2_KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4       # layers × K/V × KV heads × head dim × fp32
WORKER_LINE = re.compile(r"worker (\S+) listening on (\S+)")


@dataclass(slots=True)
class Record:
    config: str
    requests: int
    completed: int
    errors: int
    prompt_tokens: int
    cached_tokens: int                      # the client's usage.cached_tokens, all tiers
    computed_tokens: int                    # prompt tokens the workers computed
    hit_tokens: dict[str, int] = field(default_factory=dict)     # tier -> prompt tokens served from it
    hit_rate: float = 0.0                   # all hits ÷ prompt tokens (workers' count)
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    duration_s: float = 0.0
    note: str = ""


def _server_argv(config: str, args, port: int, disk: Path) -> list[str]:
    argv = [sys.executable, "-m", "splitserve", "serve", "--aggregated", "--workers", "2",
            "--port", str(port), "--grpc-port", "0", "--block-size", str(args.block_tokens),
            "--kv-cache-gib", str(args.device_gib), "--max-num-batched-tokens", str(args.chunk)]
    if config in ("host", "disk", "store"):
        argv += ["--kv-host-gib", str(args.host_gib)]
    if config == "disk":
        argv += ["--kv-disk-gib", str(args.disk_gib), "--kv-disk-path", str(disk)]
    if config == "store":
        argv += ["--kv-store-gib", str(args.store_gib)]
    return argv


def _stats(address: str) -> worker_pb2.StatsResponse:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=10)


def _follow(proc: subprocess.Popen, log, workers: dict[str, str]) -> None:
    """Copy the server's output to its log, noting each worker's gRPC address."""
    for line in proc.stdout:
        log.write(line)
        match = WORKER_LINE.search(line)
        if match:
            workers[match.group(1)] = match.group(2)


def run_config(config: str, args, scratch: Path, console: Console) -> Record:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    workers: dict[str, str] = {}
    with open(scratch / f"{config}.log", "w") as log:
        proc = subprocess.Popen(_server_argv(config, args, port, scratch / f"{config}-disk"), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        follower = threading.Thread(target=_follow, args=(proc, log, workers), daemon=True)
        follower.start()
        try:
            wait_ready(f"{url}/v1/models", proc, 300)
            deadline = time.monotonic() + 60
            while len(workers) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            out = scratch / f"{config}-bench"
            cmd = [sys.executable, "-m", "splitserve", "bench", "--url", url, "--tokenizer", "smollm2", "--workload", "trace",
                   "--prompt-format", "ids", "--trace-start", str(args.start), "--trace-block-tokens",
                   str(args.block_tokens), "--trace-max-output", str(args.max_output),
                   "--trace-time-scale", str(args.time_scale), "--arrival", "trace",
                   "--num-requests", str(args.requests), "--seed", str(args.seed), "--out", str(out),
                   "--no-plots", "--no-progress", "--request-timeout", "900"]
            bench = subprocess.run(cmd, capture_output=True, text=True)
            if bench.returncode != 0:
                raise RuntimeError(f"splitserve bench failed ({bench.returncode}): {bench.stderr[-2000:]}")
            summary = json.loads((out / "result.json").read_text())["summary"]
            stats = [_stats(address) for address in workers.values()]
        finally:
            stop_group(proc, 60)
            follower.join(10)
    tier_tokens = {"host": 0, "disk": 0, "store": 0}
    for s in stats:
        for t in s.kv_tiers:
            tier_tokens[t.tier] += t.num_hits * args.block_tokens
    hits = sum(s.num_prefix_hit_tokens for s in stats)
    computed = sum(s.num_prompt_tokens_computed for s in stats)
    hit_tokens = {"device": hits - sum(tier_tokens.values()), **tier_tokens}
    dist = lambda key, q: (summary.get(key) or {}).get(q)  # noqa: E731
    record = Record(config, summary["num_requests"],
                    summary["num_ok"], summary["num_errors"], summary["total_prompt_tokens"],
                    summary["total_cached_tokens"], computed, hit_tokens,
                    hits / max(1, hits + computed), dist("ttft_s", "p50"), dist("ttft_s", "p90"),
                    summary.get("duration_s") or 0.0)
    console.print(f"  {config}: hit rate {record.hit_rate:.1%} {hit_tokens}, TTFT p50 {record.ttft_p50_s} "
                  f"p90 {record.ttft_p90_s}, {record.completed}/{args.requests} ok")
    return record


def working_set(args) -> tuple[int, int]:
    """(blocks in the slice's prompts, unique blocks) at the scaled block size."""
    from splitserve.loadgen.datasets import default_trace_path

    blocks, unique = 0, set()
    with open(default_trace_path()) as f:
        for i, line in enumerate(f):
            if i < args.start:
                continue
            if i >= args.start + args.requests:
                break
            hash_ids = json.loads(line)["hash_ids"]
            blocks += len(hash_ids)
            unique.update(hash_ids)
    return blocks, len(unique)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="device,host,disk,store", help=f"comma-separated of {', '.join(CONFIGS)}")
    p.add_argument("--requests", type=int, default=800, help="trace records replayed (default: %(default)s)")
    p.add_argument("--start", type=int, default=0, help="first trace record")
    p.add_argument("--block-tokens", type=int, default=4, help="tokens per 512-token trace block = KV block size")
    p.add_argument("--max-output", type=int, default=32, help="cap on scaled output lengths")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply the trace's timestamps")
    p.add_argument("--device-gib", type=float, default=0.05, help="each worker's device pool")
    p.add_argument("--host-gib", type=float, default=1.0, help="each worker's host tier")
    p.add_argument("--disk-gib", type=float, default=4.0, help="each worker's disk tier")
    p.add_argument("--store-gib", type=float, default=2.0, help="the shared block store (both workers)")
    p.add_argument("--chunk", type=int, default=512, help="--max-num-batched-tokens of the workers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kv_tiers.json")
    args = p.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}; choose from {', '.join(CONFIGS)}")
    console = Console(width=200)
    blocks, unique = working_set(args)
    block_bytes = args.block_tokens * SMOLLM2_KV_BYTES_PER_TOKEN
    device_blocks = int(args.device_gib * 2**30) // block_bytes
    console.print(f"trace records {args.start}..{args.start + args.requests - 1}: {blocks} blocks, {unique} unique "
                  f"({unique * block_bytes / 2**30:.2f} GiB of KV); each worker's pool holds {device_blocks} "
                  f"({device_blocks / unique:.1%} of the unique blocks)")
    records = []
    with tempfile.TemporaryDirectory(prefix="kv-tiers-") as tmp:
        for config in configs:
            records.append(run_config(config, args, Path(tmp), console))
    table = Table(title="KV tiers on the Mooncake trace (2 aggregated workers, kv router)")
    for col in ("config", "ok", "prompt tok", "computed", "hit rate", "device", "host", "disk", "store",
                "TTFT p50 s", "TTFT p90 s", "note"):
        table.add_column(col, justify="right")
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for r in records:
        table.add_row(r.config, f"{r.completed}/{r.requests}", str(r.prompt_tokens), str(r.computed_tokens),
                      f"{r.hit_rate:.1%}", *(str(r.hit_tokens.get(t, "-")) for t in ("device", "host", "disk", "store")),
                      fmt(r.ttft_p50_s), fmt(r.ttft_p90_s), r.note)
    console.print(table)
    by = {r.config: r for r in records}
    base = by.get("device")
    best = next((by[c] for c in ("store", "disk", "host") if c in by and not by[c].note), None)
    hit_ratio = ttft_ratio = None
    if base is not None and best is not None:
        hit_ratio = best.hit_rate / base.hit_rate if base.hit_rate else None
        ttft_ratio = best.ttft_p90_s / base.ttft_p90_s if base.ttft_p90_s and best.ttft_p90_s else None
        console.print(f"all tiers ({best.config}) ÷ device only: hit rate {fmt(hit_ratio)}× (target ≥ 2), "
                      f"TTFT p90 {fmt(ttft_ratio)}× (target ≤ 0.5)")
    write_report(args.out, {
        "benchmark": "kv_tiers", "records": [asdict(r) for r in records],
        "hit_rate_ratio": hit_ratio, "ttft_p90_ratio": ttft_ratio, "all_tiers_config": best.config if best else None,
        "scale": {"trace_start": args.start, "requests": args.requests, "block_tokens": args.block_tokens,
                  "input_scale": args.block_tokens / 512, "output_scale": args.block_tokens / 512,
                  "max_output_tokens": args.max_output, "time_scale": args.time_scale,
                  "device_gib_per_worker": args.device_gib, "host_gib_per_worker": args.host_gib,
                  "disk_gib_per_worker": args.disk_gib, "store_gib": args.store_gib, "blocks": blocks, "unique_blocks": unique,
                  "device_blocks_per_worker": device_blocks},
    })
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
