"""Live migration: how long a moved request's stream waits when its KV moves, against token replay.

`splitserve serve` with one prefill and two decode workers (the shipped SmolLM2-135M unless
`--model`; 2 torch threads each, as only one of them computes at a time here), on this machine's CPU. A request streams greedy tokens; after its 8th, the bench asks
POST /admin/migrate to move it to the other decode worker (services/frontend/live_moves.py) and
reads the answer's `seconds_to_next_token`: from the decision to the next token forwarded to the
client. Two methods on the same deployment, interleaved in each repetition:
- `kv`: the KV moves (the source suspends the request and sends the KV of all but the last token
  through kvtransfer; the destination computes one token);
- `replay`: the destination recomputes the whole context (prompt + tokens so far), what a
  migration did before issue 41 and still does where the KV cannot move.
Every request has a prompt of its own, and decode workers prefill their prompts themselves
(`--remote-prefill-threshold` above any prompt), so no worker holds a replayed context in a
prefix cache: replay recomputes it all, the case live migration is for (a prefill worker's cache
may hold the prompt part, never the tokens generated since).

`kv_move_vs_replay[context]` = kv ÷ replay, paired within a repetition; target ≤ 0.3 at 8k
(issue 41) in each of `--reps` repetitions (min / median / max reported). Run it with nothing else
on the machine.

    python bench/migration.py --reps 3 --out bench/results/migration.json
    python bench/migration.py --quick             # a smoke run: one repetition, 2k only

JSON (`--out`): the commit, CPU and load (/proc/loadavg at start and end), every move's answer,
and per context the ratios (min / median / max) and whether the target held in each repetition.
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
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_support import stop_group, wait_ready  # noqa: E402

from splitserve.hardware import cpu_model, write_report  # noqa: E402
from splitserve.net import free_port  # noqa: E402

TARGET = 0.3            # kv ÷ replay at 8k
MOVE_AFTER = 8
MAX_TOKENS = 64
CONTEXTS = (2048, 8192)
VOCAB_LOW, VOCAB_HIGH = 1000, 40000    # plain token ids of SmolLM2's vocabulary


def _loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def start_serve(model: str | None, kv_cache_gib: float) -> tuple[subprocess.Popen, str]:
    port, grpc_port = free_port(), free_port()
    cmd = ["splitserve", "serve", "--prefill-workers", "1", "--decode-workers", "2", "--port", str(port),
           "--grpc-port", str(grpc_port), "--threads", "2", "--kv-cache-gib", str(kv_cache_gib),
           "--remote-prefill-threshold", "1000000", *(["--model", model] if model else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    wait_ready(f"{base}/ready", proc, timeout=600)
    return proc, base


async def moved_once(client: httpx.AsyncClient, base: str, model: str, prompt: list[int], method: str) -> dict:
    """Stream one request and move it after MOVE_AFTER tokens; the move's answer."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    num_tokens, moving = 0, None
    async with client.stream("POST", f"{base}/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise SystemExit(f"the request was refused: {reply.status_code} {(await reply.aread()).decode()}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            num_tokens += len(chunk["choices"][0].get("token_ids") or [])
            if moving is None and num_tokens >= MOVE_AFTER:
                moving = asyncio.ensure_future(client.post(f"{base}/admin/migrate", json={
                    "request_id": chunk["id"], "method": method, "timeout_s": 900}))
    answer = await moving
    if answer.status_code != 200:
        raise SystemExit(f"the move was refused: {answer.status_code} {answer.text}")
    moved = answer.json()
    if moved["method"] != method:
        raise SystemExit(f"asked for {method}, the move was {moved['method']}: {moved}")
    return moved


async def run(base: str, contexts: tuple[int, ...], reps: int) -> list[dict]:
    rng = random.Random(20261206)
    moves = []
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        await moved_once(client, base, model, [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(256)], "kv")  # warm-up
        for rep in range(reps):
            for context in contexts:
                methods = ("kv", "replay") if rep % 2 == 0 else ("replay", "kv")
                for method in methods:
                    prompt = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(context - MAX_TOKENS - 16)]
                    moved = await moved_once(client, base, model, prompt, method)
                    moves.append({"rep": rep, "context": context, **moved})
                    print(f"  rep {rep} {context:>5} {method:<6} {moved['seconds_to_next_token'] * 1000:8.1f} ms "
                          f"({moved['from']} -> {moved['to']})", flush=True)
    return moves


def summarize(moves: list[dict], contexts: tuple[int, ...], reps: int) -> dict:
    out = {}
    for context in contexts:
        by = {(m["rep"], m["method"]): m["seconds_to_next_token"] for m in moves if m["context"] == context}
        ratios = [by[(r, "kv")] / by[(r, "replay")] for r in range(reps)]
        out[str(context)] = {
            "kv_ms": [round(by[(r, "kv")] * 1000, 2) for r in range(reps)],
            "replay_ms": [round(by[(r, "replay")] * 1000, 2) for r in range(reps)],
            "ratios": [round(x, 4) for x in ratios],
            "min": round(min(ratios), 4), "median": round(statistics.median(ratios), 4), "max": round(max(ratios), 4),
            "target_met_every_rep": all(x <= TARGET for x in ratios)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--model", default=None, help="a checkpoint for serve (default: the shipped SmolLM2)")
    parser.add_argument("--kv-cache-gib", type=float, default=1.5, help="per worker (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="one repetition at 2k only (a smoke run)")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    contexts, reps = ((2048,), 1) if args.quick else (CONTEXTS, args.reps)
    load_start = _loadavg()
    print(f"live migration, KV move vs token replay: {cpu_model()}, {os.cpu_count()} cores, load {load_start}")
    proc, base = start_serve(args.model, args.kv_cache_gib)
    try:
        started = time.monotonic()
        moves = asyncio.run(run(base, contexts, reps))
    finally:
        stop_group(proc, 30)
    summary = summarize(moves, contexts, reps)
    print(f"\n{'context':>8} {'kv ms (median)':>15} {'replay ms (median)':>19} {'kv/replay min':>14} "
          f"{'median':>7} {'max':>7}")
    for context, s in summary.items():
        print(f"{context:>8} {statistics.median(s['kv_ms']):>15.1f} {statistics.median(s['replay_ms']):>19.1f} "
              f"{s['min']:>14.3f} {s['median']:>7.3f} {s['max']:>7.3f}")
    if "8192" in summary:
        met = summary["8192"]["target_met_every_rep"]
        print(f"target kv/replay <= {TARGET} at 8k in every repetition: {'met' if met else 'NOT met'}")
    if args.out:
        write_report(args.out, {
            "load_start": load_start, "load_end": _loadavg(), "reps": reps, "move_after": MOVE_AFTER,
            "model": args.model or "shipped SmolLM2-135M-Instruct", "seconds": round(time.monotonic() - started, 1),
            "target": TARGET, "kv_move_vs_replay": {c: s["median"] for c, s in summary.items()},
            "contexts": summary, "moves": moves})
    return 0


if __name__ == "__main__":
    sys.exit(main())
