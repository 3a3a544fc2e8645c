"""What structured outputs cost: decode tokens/s with a JSON schema vs without, same run.

    python bench/structured_outputs.py [--batch 1 16] [--tokens 64] [--rounds 5] [--threads N] [--out FILE]

The shipped SmolLM2 in one in-process engine (the worker's engine, no network),
greedy, `--tokens` decode tokens per sequence at each batch size. The constrained
run uses a schema whose instance is far longer than `--tokens` (40 rows of objects),
so both runs decode the same number of tokens and stop on max_tokens; the free run
ignores EOS for the same reason. Only decode steps are timed (from the step after
every sequence got its first token). Free and constrained rounds alternate, and
the figure is the median of `--rounds` rounds: this machine is noisy, and the ratio
of the two medians is what to compare (issue 19's target: at most 10 % slower at
batch 16). The process is pinned to `--threads` cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from splitserve.hardware import cpu_model, write_report

ROW = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                        "score": {"type": "integer", "minimum": 0, "maximum": 1000},
                                        "tags": {"type": "array", "items": {"enum": ["new", "old", "hot"]},
                                                 "maxItems": 3}},
       "required": ["name", "score", "tags"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"rows": {"type": "array", "items": ROW, "minItems": 40, "maxItems": 40}},
          "required": ["rows"], "additionalProperties": False}
PROMPT = "List forty people with a score and tags, as JSON."


def decode_tokens_per_s(engine, batch: int, tokens: int, structured, round_id: str) -> float:
    from splitserve.services.worker_protocol.sampling_params import SamplingParams

    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, structured=structured)
    ids = [f"{round_id}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, prompt, params)
    counts = dict.fromkeys(ids, 0)
    started = None
    decoded = 0
    while engine.has_unfinished():
        outputs = engine.step()
        for out in outputs:
            counts[out.request_id] += len(out.new_token_ids)
            if started is not None:
                decoded += len(out.new_token_ids)
        if started is None and all(counts.values()):
            started = time.perf_counter()       # every sequence has its first token: decode from here
    elapsed = time.perf_counter() - started
    assert all(c == tokens for c in counts.values()), counts
    return decoded / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per sequence")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:args.threads]))
    from splitserve.services.engine.config import EngineConfig
    from splitserve.services.engine.engine import LLMEngine
    from splitserve.services.engine.loading.smollm2 import resolve_smollm2
    from splitserve.services.worker_protocol.sampling_params import StructuredOutput

    engine = LLMEngine(EngineConfig(model=str(resolve_smollm2(progress=False)), num_threads=args.threads,
                                    num_kv_blocks=max(64, max(args.batch) * 8)))
    schema = StructuredOutput("json_schema", json.dumps(SCHEMA))
    engine.structured_outputs.compile(schema)           # xgrammar's import and the compile: not decode
    results = {}
    for batch in args.batch:
        decode_tokens_per_s(engine, batch, 4, None, f"warm{batch}")
        runs: dict[str, list[float]] = {"free": [], "schema": []}
        for r in range(args.rounds):
            order = [("free", None), ("schema", schema)]
            for name, spec in order if r % 2 == 0 else order[::-1]:
                runs[name].append(decode_tokens_per_s(engine, batch, args.tokens, spec, f"{name}{batch}-{r}"))
        free, constrained = statistics.median(runs["free"]), statistics.median(runs["schema"])
        results[batch] = {"free_tok_s": free, "schema_tok_s": constrained, "ratio": constrained / free,
                          "slower_pct": 100 * (1 - constrained / free), "runs": runs}
    print(f"structured outputs: SmolLM2, {args.tokens} decode tokens per sequence, {args.threads} thread(s), "
          f"median of {args.rounds} rounds, {cpu_model()}")
    print(f"{'batch':>5} {'free tok/s':>11} {'schema tok/s':>13} {'ratio':>6} {'slower':>7}")
    for batch, r in results.items():
        print(f"{batch:>5} {r['free_tok_s']:>11.1f} {r['schema_tok_s']:>13.1f} {r['ratio']:>6.3f} "
              f"{r['slower_pct']:>6.1f}%")
    if args.out:
        from importlib.metadata import version
        write_report(args.out, {"threads": args.threads, "tokens": args.tokens, "rounds": args.rounds,
                                "xgrammar": version("xgrammar"), "schema": SCHEMA,
                                "results": {str(b): r for b, r in results.items()}})
    engine.close()


if __name__ == "__main__":
    main()
