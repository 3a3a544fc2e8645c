"""Which grammar library to build structured outputs on: xgrammar against llguidance, here.

For each JSON schema of a small set (flat to nested, with enums, arrays and patterns), on the
shipped SmolLM2's tokenizer (49,152 tokens):
- `compile`: from the schema to a matcher ready for its first token;
- `mask`: filling one row of the next-token bitmask, per generated token, while a matcher
  follows a valid instance of the schema token by token (mean and p99 over every step);
- `batch 16`: one step of 16 matchers filling their rows of one bitmask (what the sampler
  would do per decode step at batch 16).
Both libraries run single-threaded (this machine has two cores; the engine owns them). The
ratio column is xgrammar / llguidance: below 1, xgrammar is faster.

Needs `pip install xgrammar llguidance` (not project dependencies yet).

    python bench/grammar_backends.py --out bench/results/grammar_backends.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from splitserve.hardware import cpu_model, write_report

SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False},
             {"name": "Ada Lovelace", "age": 36}),
    "enum+array": ({"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": ["colour", "tags"], "additionalProperties": False},
        {"colour": "green", "tags": ["grass", "leaf", "lime"]}),
    "nested": ({"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer"}, "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
            "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}}},
            "required": ["id", "email", "roles"], "additionalProperties": False},
        "active": {"type": "boolean"}, "score": {"type": "number"}},
        "required": ["user", "active", "score"], "additionalProperties": False},
        {"user": {"id": 7, "email": "ada@example.com", "roles": ["admin", "dev"]}, "active": True,
         "score": 0.75}),
}


def _smollm2_tokenizer():
    from transformers import AutoTokenizer

    from splitserve.services.engine.loading.smollm2 import resolve_smollm2
    return AutoTokenizer.from_pretrained(str(resolve_smollm2(progress=False)))


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.vocab = self.info.vocab_size

    def matcher(self, schema: dict):
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema)))

    def bitmask(self, rows: int):
        return self.xgr.allocate_token_bitmask(rows, self.vocab)

    def fill(self, matcher, bitmask, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token: int) -> None:
        assert matcher.accept_token(token), token


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf_tokenizer)
        self.vocab = self.tok.vocab_size

    def matcher(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = self.llg.LLMatcher(self.tok, grammar)
        assert not m.is_error(), m.get_error()
        return m

    def bitmask(self, rows: int):
        return self.llg.torch.allocate_token_bitmask(rows, self.vocab)

    def fill(self, matcher, bitmask, row: int) -> None:
        self.llg.torch.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


def measure(backend, hf_tokenizer, schema: dict, instance: dict, reps: int) -> dict:
    text = json.dumps(instance, separators=(", ", ": "))
    tokens = hf_tokenizer.encode(text, add_special_tokens=False)
    compile_s = []
    for _ in range(reps):
        t0 = time.perf_counter()
        backend.matcher(schema)
        compile_s.append(time.perf_counter() - t0)
    mask_s = []
    bitmask = backend.bitmask(1)
    for _ in range(reps):
        m = backend.matcher(schema)
        for t in tokens:
            t0 = time.perf_counter()
            backend.fill(m, bitmask, 0)
            mask_s.append(time.perf_counter() - t0)
            backend.accept(m, t)
    batch = backend.bitmask(16)
    matchers = [backend.matcher(schema) for _ in range(16)]
    step_s = []
    for t in tokens:
        t0 = time.perf_counter()
        for row, m in enumerate(matchers):
            backend.fill(m, batch, row)
        step_s.append(time.perf_counter() - t0)
        for m in matchers:
            backend.accept(m, t)
    mask_s.sort()
    return {"tokens": len(tokens), "compile_ms": 1e3 * statistics.median(compile_s),
            "mask_mean_us": 1e6 * statistics.mean(mask_s), "mask_p99_us": 1e6 * mask_s[int(0.99 * (len(mask_s) - 1))],
            "batch16_step_us": 1e6 * statistics.median(step_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    import torch
    torch.set_num_threads(1)
    hf = _smollm2_tokenizer()
    backends = [XGrammar(hf), LLGuidance(hf)]
    results: dict[str, dict[str, dict]] = {b.name: {} for b in backends}
    for turn, (name, (schema, instance)) in enumerate(SCHEMAS.items()):
        for backend in backends if turn % 2 else backends[::-1]:       # alternate who goes first
            results[backend.name][name] = measure(backend, hf, schema, instance, args.reps)
    print(f"grammar backends on SmolLM2's tokenizer ({backends[0].vocab} tokens), 1 thread, {cpu_model()}")
    print(f"{'schema':<11} {'backend':<11} {'compile ms':>10} {'mask us':>8} {'p99 us':>7} {'batch16 us':>10}")
    for name in SCHEMAS:
        for b in backends:
            r = results[b.name][name]
            print(f"{name:<11} {b.name:<11} {r['compile_ms']:>10.2f} {r['mask_mean_us']:>8.1f} "
                  f"{r['mask_p99_us']:>7.1f} {r['batch16_step_us']:>10.1f}")
        x, g = results["xgrammar"][name], results["llguidance"][name]
        print(f"{name:<11} {'ratio x/l':<11} {x['compile_ms'] / g['compile_ms']:>10.2f} "
              f"{x['mask_mean_us'] / g['mask_mean_us']:>8.2f} {x['mask_p99_us'] / g['mask_p99_us']:>7.2f} "
              f"{x['batch16_step_us'] / g['batch16_step_us']:>10.2f}")
    if args.out:
        from importlib.metadata import version
        write_report(args.out, {"versions": {"xgrammar": version("xgrammar"), "llguidance": version("llguidance")},
                                "results": results})


if __name__ == "__main__":
    main()
