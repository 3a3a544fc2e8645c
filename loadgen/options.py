"""Parsed command-line options → a `BenchSpec`: tokenizer, model name, workload, arrivals, limits.

Kept apart from `cli.py` so that the parser stays a declaration and this stays
a set of small decisions, each with its error message: which model to ask for,
which tokenizer builds prompts, which workload and arrival process, what bounds.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx

from splitserve.errors import SplitserveError

from splitserve.loadgen import datasets, workloads
from splitserve.loadgen.arrivals import make_arrivals
from splitserve.loadgen.bench import BenchSpec
from splitserve.loadgen.client import Target
from splitserve.loadgen.runner import Limits
from splitserve.loadgen.tokens import PromptVocab, load_tokenizer
from splitserve.loadgen.workloads import LengthDist, Workload

DEFAULT_NUM_REQUESTS = 100


def served_models(url: str) -> list[str]:
    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    try:
        reply = httpx.get(base + "/models", timeout=10.0, trust_env=False)
        reply.raise_for_status()
        return [m["id"] for m in reply.json().get("data", [])]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise SplitserveError(f"cannot list the models at {base}/models ({exc}); pass --model NAME") from None


def resolve_model(url: str, model: str | None) -> str:
    """`model` as given, unless absent or a local path: then the server's only model."""
    if model and not Path(model).expanduser().exists():
        return model
    names = served_models(url)
    if len(names) != 1:
        raise SplitserveError(f"the server lists {len(names)} models ({', '.join(names) or 'none'}); "
                              "pass --model NAME")
    return names[0]


def load_vocab(tokenizer: str | None, model: str | None) -> PromptVocab:
    spec = tokenizer or model
    if not spec:
        raise SplitserveError("pass --tokenizer ('smollm2', a model folder or a .gguf file) to build prompts")
    try:
        return PromptVocab(load_tokenizer(spec))
    except SplitserveError as exc:
        raise SplitserveError(f"cannot load the tokenizer {spec!r} ({exc}); pass --tokenizer") from None


def build_workload(args: argparse.Namespace, vocab: PromptVocab, num_requests: int | None) -> Workload:
    out_len = LengthDist.parse(args.output_len)
    if args.workload == "synthetic":
        in_len = LengthDist.parse(args.input_len)
        n = workloads.num_conversations_for(num_requests, 1)
        return Workload("synthetic", workloads.synthetic(vocab, n, in_len, out_len, args.seed),
                        {"input_len": in_len.describe(), "output_len": out_len.describe(), "seed": args.seed})
    if args.workload == "shared-prefix":
        q_len = LengthDist.parse(args.question_len)
        convs = workloads.shared_prefix(vocab, args.tenants, args.prefix_len, args.questions_per_tenant,
                                        q_len, out_len, args.seed)
        return Workload("shared-prefix", convs, {
            "tenants": args.tenants, "prefix_len": args.prefix_len, "questions_per_tenant": args.questions_per_tenant,
            "question_len": q_len.describe(), "output_len": out_len.describe(), "seed": args.seed})
    if args.workload == "multi-turn":
        in_len = LengthDist.parse(args.input_len)
        n = workloads.num_conversations_for(num_requests, args.turns)
        return Workload("multi-turn", workloads.multi_turn(vocab, n, args.turns, in_len, out_len, args.seed),
                        {"turns": args.turns, "input_len": in_len.describe(), "output_len": out_len.describe(),
                         "think_time_s": args.think_time, "seed": args.seed})
    if args.workload == "trace":
        return datasets.mooncake_trace(vocab, args.trace, num_requests=num_requests, start=args.trace_start,
                                       block_tokens=args.trace_block_tokens, output_scale=args.trace_output_scale,
                                       max_output_tokens=args.trace_max_output,
                                       max_input_tokens=args.trace_max_input,
                                       conversations=args.trace_conversations, min_turns=args.trace_min_turns,
                                       time_scale=args.trace_time_scale, seed=args.seed)
    if args.dataset is None:
        raise SplitserveError("--workload sharegpt needs --dataset PATH")
    return datasets.sharegpt(vocab, args.dataset, max_turns=args.sharegpt_turns,
                             max_input_tokens=args.max_input_len, max_output_tokens=args.max_output_len,
                             seed=args.seed)


def _arrival_kind(args: argparse.Namespace) -> str:
    if args.arrival:
        return args.arrival
    if args.workload == "trace":
        return "trace"
    return "poisson" if (args.rate is not None or args.sweep_rates) else "concurrency"


def build_spec(args: argparse.Namespace) -> BenchSpec:
    if args.api == "chat" and args.prompt_format == "ids":
        raise SplitserveError("--prompt-format ids works with --api completions only")
    num_requests = args.num_requests
    whole_conversations = args.workload == "trace" and args.trace_conversations is not None
    if num_requests is None and args.duration is None and not whole_conversations:
        num_requests = DEFAULT_NUM_REQUESTS
    unbounded = num_requests is None and args.duration is None      # whole conversations: their requests
    limits = None if unbounded else Limits(num_requests, args.duration, args.request_timeout, args.drain_timeout)
    vocab = load_vocab(args.tokenizer, args.model)
    target = Target(args.url, resolve_model(args.url, args.model), args.api, args.prompt_format,
                    args.ignore_eos, args.temperature)
    workload = build_workload(args, vocab, num_requests)
    if limits is None:
        limits = Limits(sum(len(c.turns) for c in workload.conversations), None, args.request_timeout,
                        args.drain_timeout)
    kind = _arrival_kind(args)
    rate = args.rate if args.rate is not None else (1.0 if args.sweep_rates else None)
    arrivals = make_arrivals(kind, rate=rate, concurrency=args.concurrency, seed=args.seed)
    return BenchSpec(target, vocab, workload, arrivals, limits, parse_slo(args.slo), args.think_time,
                     progress=not args.no_progress, label=args.label or workload.name)


def parse_slo(text: str | None):
    from splitserve.loadgen.metrics import SLO

    if not text:
        return SLO()
    values = {}
    for part in text.split(","):
        key, _, raw = part.partition("=")
        key, raw = key.strip(), raw.strip().lower()
        if key not in ("ttft", "itl", "e2e") or not raw:
            raise SplitserveError(f"bad --slo part {part!r}: use ttft=S,itl=S,e2e=S (seconds, or e.g. 200ms)")
        try:
            values[f"{key}_s"] = float(raw[:-2]) / 1000 if raw.endswith("ms") else float(raw.removesuffix("s"))
        except ValueError:
            raise SplitserveError(f"bad --slo value {raw!r}") from None
    return SLO(**values)
