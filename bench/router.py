"""Router micro-benchmarks (issue 6): decision latency and KV-event ingestion.

    python bench/router.py [--workers 8 64 256] [--blocks-per-worker 100000] [--out router.json]

Decision latency: a RouterCore with the `kv` policy on both legs, N workers, each
holding `blocks-per-worker` cached blocks (chains of 64 blocks drawn from a
shared pool, so popular prefixes sit on several workers); one decision = hash
a 1024-token prompt (64 blocks), walk the index, score, pick, account the
load, finish. Ingestion: KvEventBatch protobufs of 64 single-block
BlockStored/BlockRemoved events through EventSubscriber.apply (what the
subscriber does per message, parsing aside). Prints a table, writes JSON with
`decision_p50_us`/`decision_p99_us` keyed by worker count and `events_per_s`.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

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


def decision_latency(num_workers: int, blocks_per_worker: int, num_decisions: int) -> tuple[float, float]:
    rng = random.Random(0)
    core, ids, prompts = build(num_workers, blocks_per_worker, rng)
    gc.collect()
    gc.disable()
    samples = []
    try:
        for i in range(num_decisions):
            prompt = prompts[i % len(prompts)] if i % 2 == 0 else [rng.randrange(32000) for _ in range(CHAIN * BS)]
            t = time.perf_counter()
            d = core.route(f"r{i}", prompt, ids, [])
            samples.append(time.perf_counter() - t)
            assert d is not None
            core.on_finished(f"r{i}")
    finally:
        gc.enable()
    samples.sort()
    return statistics.median(samples) * 1e6, samples[int(len(samples) * 0.99)] * 1e6


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--blocks-per-worker", type=int, default=100_000)
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--events", type=int, default=500_000)
    ap.add_argument("--out", default="router-bench.json")
    args = ap.parse_args()
    result = {"blocks_per_worker": args.blocks_per_worker, "decision_p50_us": {}, "decision_p99_us": {}}
    print(f"{'workers':>8} {'p50 µs':>10} {'p99 µs':>10}")
    for n in args.workers:
        p50, p99 = decision_latency(n, args.blocks_per_worker, args.decisions)
        result["decision_p50_us"][str(n)], result["decision_p99_us"][str(n)] = round(p50, 1), round(p99, 1)
        print(f"{n:>8} {p50:>10.1f} {p99:>10.1f}", flush=True)
    result["events_per_s"] = round(ingestion(args.events))
    print(f"event ingestion: {result['events_per_s']:,} events/s")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
