"""Router micro-benchmarks (issue 6): decision latency and KV-event ingestion.

    python bench/router.py [--workers 8 64 256] [--blocks-per-worker 100000] [--out router.json]

Decision latency: a RouterCore with the `kv` policy on both legs, N workers, each
holding `blocks-per-worker` cached blocks (chains of 64 blocks drawn from a
shared pool, so popular prefixes sit on several workers); one decision = hash
a 1024-token prompt (64 blocks), walk the index, score, pick, account the
load, finish. Ingestion: KvEventBatch protobufs of 64 single-block
BlockStored/BlockRemoved events through EventSubscriber.apply (what the
subscriber does per message, parsing aside). Prints a table, writes JSON with
`decision_p50_us`/`decision_p99_us` keyed by worker count (wall clock, so a
busy machine's preemptions land in p99), `decision_cpu_p99_us` (this thread's
CPU time, which they do not), and `events_per_s`.

    python bench/router.py --e2e [--e2e-requests 96] [--out router-e2e.json]

End to end (loopback only): for each of `kv` and `round-robin`, `splitserve serve
--aggregated --workers 4 --router P` on a random-weight Llama, then `splitserve
bench --workload shared-prefix` at the same closed-loop load; the workers' own
counters give the prefix-hit rate and the prompt tokens they computed
(`--e2e-prefill-weight` is passed to serve as --prefill-weight). Writes
`ttft_p50_s`/`ttft_p90_s`/`prefix_hit_rate`/`prefill_tokens_computed` keyed by policy.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from splitserve.proto.v1 import worker_pb2
from splitserve.router.core import RouterCore, WorkerSpec
from splitserve.router.hashing import block_hashes
from splitserve.router.index import KvIndex
from splitserve.router.policies import make_policy
from splitserve.router.subscriber import EventSubscriber

CHAIN = 64
BS = 16
KEY = b"bench|torch.bfloat16|"


def build(num_workers: int, blocks_per_worker: int, rng: random.Random):
    chains_per_worker = blocks_per_worker // CHAIN
    pool_size = max(chains_per_worker * 2, 64)
    prompts = [[rng.randrange(32000) for _ in range(CHAIN * BS)] for _ in range(64)]
    prompt_chains = [block_hashes(p, BS, KEY) for p in prompts]
    synthetic = [[rng.randbytes(32) for _ in range(CHAIN)] for _ in range(pool_size - len(prompt_chains))]
    chains = prompt_chains + synthetic
    core = RouterCore(make_policy("kv"), make_policy("kv"))
    ids = [f"w{i}" for i in range(num_workers)]
    for wid in ids:
        core.set_spec(wid, WorkerSpec(BS, KEY))
        for c in rng.sample(range(len(chains)), chains_per_worker):
            core.index.stored(wid, chains[c])
    return core, ids, prompts


def decision_latency(num_workers: int, blocks_per_worker: int, num_decisions: int) -> tuple[float, float, float]:
    rng = random.Random(0)
    core, ids, prompts = build(num_workers, blocks_per_worker, rng)
    gc.collect()
    gc.disable()
    samples, cpu = [], []
    try:
        for i in range(num_decisions):
            prompt = prompts[i % len(prompts)] if i % 2 == 0 else [rng.randrange(32000) for _ in range(CHAIN * BS)]
            c = time.thread_time()
            t = time.perf_counter()
            d = core.route(f"r{i}", prompt, ids, [])
            samples.append(time.perf_counter() - t)
            cpu.append(time.thread_time() - c)
            assert d is not None
            core.on_finished(f"r{i}")
    finally:
        gc.enable()
    samples.sort()
    cpu.sort()
    p99 = int(len(samples) * 0.99)
    return statistics.median(samples) * 1e6, samples[p99] * 1e6, cpu[p99] * 1e6


def ingestion(num_events: int) -> float:
    rng = random.Random(1)
    batches, seq, live = [], 0, []
    while seq < num_events:
        events = []
        for _ in range(64):
            seq += 1
            if live and rng.random() < 0.4:
                h = live.pop(rng.randrange(len(live)))
                events.append(worker_pb2.KvEvent(seq=seq, removed=worker_pb2.BlockRemoved(block_hashes=[h])))
            else:
                h = rng.randbytes(32)
                live.append(h)
                events.append(worker_pb2.KvEvent(seq=seq, stored=worker_pb2.BlockStored(block_hashes=[h])))
        batches.append(worker_pb2.KvEventBatch(worker_id="w", instance_id="i", last_seq=seq, events=events))
    sub = EventSubscriber("w", KvIndex())
    sub.apply(worker_pb2.KvEventBatch(worker_id="w", instance_id="i", snapshot=True, last_seq=0))
    t = time.perf_counter()
    for b in batches:
        sub.apply(b)
    return seq / (time.perf_counter() - t)


# -- end to end: splitserve serve + splitserve bench, kv vs round-robin -------------------------------
E2E_POLICIES = ("kv", "round-robin")
CHILD_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_counters(addresses: list[str]) -> dict[str, int]:
    import grpc

    from splitserve.proto.v1 import worker_pb2_grpc

    total = {"num_prompt_tokens_computed": 0, "num_prefix_hit_tokens": 0}
    for a in addresses:
        with grpc.insecure_channel(a) as channel:
            s = worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=10)
        for k in total:
            total[k] += getattr(s, k)
    return total


def _serve(model: Path, policy: str, num_workers: int, timeout_s: float,
           prefill_weight: float) -> tuple[subprocess.Popen, str, list[str]]:
    port = _free_port()
    proc = subprocess.Popen(["splitserve", "serve", "--aggregated", "--workers", str(num_workers), "--router", policy,
                             "--prefill-weight", str(prefill_weight), "--model", str(model), "--port", str(port),
                             "--grpc-port", "0", "--threads", "1", "--kv-cache-gib", "0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **CHILD_ENV}, start_new_session=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if "splitserve is ready" in line:
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(timeout_s) or proc.poll() is not None or not any("splitserve is ready" in x for x in lines):
        _stop(proc)
        raise RuntimeError("splitserve serve did not become ready:\n" + "\n".join(lines[-40:]))
    workers = [m.group(1) for x in lines if (m := re.search(r"worker-\d+ ready .* at (\S+)$", x))]
    return proc, f"http://127.0.0.1:{port}", workers


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def end_to_end(num_requests: int, concurrency: int, num_workers: int, prefix_len: int, out_dir: Path,
               timeout_s: float, prefill_weight: float = 1.0) -> dict[str, dict[str, float]]:
    from splitserve.testing.models import build_random_model

    model = build_random_model("llama", out_dir / "model", seed=0)
    rows: dict[str, dict[str, float]] = {}
    for policy in E2E_POLICIES:
        proc, base, workers = _serve(model, policy, num_workers, timeout_s, prefill_weight)
        try:
            before = _worker_counters(workers)
            run_dir = out_dir / policy
            subprocess.run(["splitserve", "bench", "--url", base, "--tokenizer", str(model), "--prompt-format", "ids",
                            "--workload", "shared-prefix", "--tenants", "8",
                            "--prefix-len", str(prefix_len), "--questions-per-tenant", str(num_requests // 8),
                            "--question-len", "32", "--output-len", "4", "--arrival", "concurrency",
                            "--concurrency", str(concurrency), "--num-requests", str(num_requests), "--seed", "0",
                            "--out", str(run_dir), "--label", policy, "--no-plots", "--no-progress"],
                           check=True, timeout=timeout_s, env={**os.environ, **CHILD_ENV},
                           stdout=subprocess.DEVNULL)
            after = _worker_counters(workers)
        finally:
            _stop(proc)
        summary = json.loads((run_dir / "result.json").read_text())["summary"]
        computed = after["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"]
        hit = after["num_prefix_hit_tokens"] - before["num_prefix_hit_tokens"]
        rows[policy] = {"ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p90_s": summary["ttft_s"]["p90"],
                        "prefix_hit_rate": hit / max(hit + computed, 1), "prefill_tokens_computed": computed,
                        "num_ok": summary["num_ok"], "num_errors": summary["num_errors"]}
    return rows


def main_e2e(args) -> int:
    with tempfile.TemporaryDirectory(prefix="router-e2e-") as tmp:
        rows = end_to_end(args.e2e_requests, args.e2e_concurrency, 4, args.e2e_prefix_len, Path(tmp),
                          args.e2e_timeout, args.e2e_prefill_weight)
    result = {key: {p: r[key] for p, r in rows.items()}
              for key in ("ttft_p50_s", "ttft_p90_s", "prefix_hit_rate", "prefill_tokens_computed")}
    kv, rr = rows["kv"]["ttft_p90_s"], rows["round-robin"]["ttft_p90_s"]
    result["ttft_p90_ratio_kv_over_round_robin"] = round(kv / rr, 3) if rr else None
    result["e2e_load"] = {"workers": 4, "requests": args.e2e_requests, "concurrency": args.e2e_concurrency,
                          "tenants": 8, "prefix_len": args.e2e_prefix_len, "question_len": 32, "output_len": 4,
                          "kv_prefill_weight": args.e2e_prefill_weight}
    print(f"{'policy':>12} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} {'prefix hit':>11} {'prefill tokens':>15}")
    for p, r in rows.items():
        print(f"{p:>12} {r['ttft_p50_s'] * 1e3:>12.1f} {r['ttft_p90_s'] * 1e3:>12.1f} "
              f"{r['prefix_hit_rate']:>11.1%} {r['prefill_tokens_computed']:>15,}")
    print(f"kv TTFT p90 / round-robin TTFT p90 = {result['ttft_p90_ratio_kv_over_round_robin']} (target <= 0.5)")
    _merge_json(args.out, result)
    return 0


def _merge_json(path: str, result: dict) -> None:
    """Add `result`'s keys to the JSON at `path` (the micro and end-to-end runs share one file)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        doc = {}
    doc.update(result)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--blocks-per-worker", type=int, default=100_000)
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--events", type=int, default=500_000)
    ap.add_argument("--out", default="router-bench.json")
    ap.add_argument("--e2e", action="store_true", help="run the end-to-end kv vs round-robin comparison instead")
    ap.add_argument("--e2e-requests", type=int, default=96)
    ap.add_argument("--e2e-concurrency", type=int, default=4)
    ap.add_argument("--e2e-prefix-len", type=int, default=1024)
    ap.add_argument("--e2e-prefill-weight", type=float, default=1.0, help="serve --prefill-weight (kv policy)")
    ap.add_argument("--e2e-timeout", type=float, default=600.0, help="seconds per serve start and per bench run")
    args = ap.parse_args()
    if args.e2e:
        return main_e2e(args)
    result = {"blocks_per_worker": args.blocks_per_worker, "decision_p50_us": {}, "decision_p99_us": {},
              "decision_cpu_p99_us": {}}
    print(f"{'workers':>8} {'p50 µs':>10} {'p99 µs':>10} {'cpu p99 µs':>11}")
    for n in args.workers:
        p50, p99, cpu99 = decision_latency(n, args.blocks_per_worker, args.decisions)
        result["decision_p50_us"][str(n)], result["decision_p99_us"][str(n)] = round(p50, 1), round(p99, 1)
        result["decision_cpu_p99_us"][str(n)] = round(cpu99, 1)
        print(f"{n:>8} {p50:>10.1f} {p99:>10.1f} {cpu99:>11.1f}", flush=True)
    result["events_per_s"] = round(ingestion(args.events))
    print(f"event ingestion: {result['events_per_s']:,} events/s")
    _merge_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
