"""What the penalties cost per decode step: counts kept as tokens are accepted vs rebuilt.

One step of `apply_logits_controls` + the engine's per-token count update on a batch of
random logits over SmolLM2's vocabulary (49,152), each row with `--history` tokens of prompt
+ output behind it, in three modes, interleaved over the repetitions (medians):
- `none`: no penalties (the floor: what a batch without controls pays);
- `rebuilt`: presence/frequency/repetition penalties with the counts rebuilt from the whole
  history every step (what the engine did before it kept counts);
- `kept`: the same penalties with each sequence's `TokenCounts`, updated per accepted token
  (what the engine does now).
The `vs none` column is each mode's time over `none`'s.

    python bench/logits_controls.py --out bench/results/logits_controls.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from splitserve.hardware import cpu_model
from splitserve.services.engine.logits_controls import TokenCounts, TokenHistory, apply_logits_controls
from splitserve.services.worker_protocol.sampling_params import SamplingParams

VOCAB = 49152


def _step(mode: str, logits: torch.Tensor, histories: list[list[int]], counts: list[TokenCounts],
          params: list[SamplingParams]) -> None:
    if mode == "rebuilt":
        rows = [TokenHistory(h, len(h) // 2, len(h) // 2) for h in histories]
    else:
        rows = [TokenHistory([], len(h) // 2, len(h) // 2, c if mode == "kept" else None)
                for h, c in zip(histories, counts)]
    out = apply_logits_controls(logits, params, rows, set())
    tokens = out.argmax(dim=-1).tolist()
    for h, c, t in zip(histories, counts, tokens):      # the engine's _append_token
        h.append(t)
        if mode == "kept":
            c.add(t)


def measure(batch: int, history: int, repetitions: int, steps: int) -> dict[str, float]:
    rng = random.Random(0)
    penalized = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    plain = SamplingParams()
    times: dict[str, list[float]] = {"none": [], "rebuilt": [], "kept": []}
    modes = list(times)
    for rep in range(repetitions):
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            histories = [[rng.randrange(VOCAB) for _ in range(history)] for _ in range(batch)]
            counts = [TokenCounts.of(h, len(h) // 2, VOCAB) for h in histories]
            params = [plain if mode == "none" else penalized] * batch
            logits = torch.randn(batch, VOCAB)
            _step(mode, logits, histories, counts, params)             # warm-up
            start = time.perf_counter()
            for _ in range(steps):
                _step(mode, logits, histories, counts, params)
            times[mode].append((time.perf_counter() - start) / steps * 1e3)
    return {mode: statistics.median(ts) for mode, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--history", type=int, default=2048, help="prompt + output tokens per row")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"logits controls, vocab {VOCAB}, history {args.history}, {args.threads} thread(s), {cpu_model()}")
    print(f"{'batch':>5} {'mode':>8} {'ms/step':>9} {'vs none':>8}")
    report = []
    for batch in (int(b) for b in args.batches.split(",")):
        ms = measure(batch, args.history, args.repetitions, args.steps)
        for mode, value in ms.items():
            print(f"{batch:>5} {mode:>8} {value:>9.3f} {value / ms['none']:>7.1f}x")
        report.append({"batch": batch, "ms_per_step": ms})
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "cpu": cpu_model(), "vocab": VOCAB, "history": args.history, "threads": args.threads,
            "results": report}, indent=2) + "\n")


if __name__ == "__main__":
    main()
