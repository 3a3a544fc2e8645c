"""Command line of the load generator: `splitserve bench ...` and `python -m splitserve.loadgen ...`.

    splitserve bench --url URL [--model NAME] [workload options] [--out DIR]
    splitserve bench compare A.json B.json

`--model` is the name sent in requests (default: the one model the server
lists at /v1/models; a folder path also means "ask the server"); the tokenizer
that builds prompts is `--tokenizer` ('smollm2', a model folder or a .gguf
file), by default `--model` itself. Everything runs bounded: `--num-requests`
and/or `--duration` (100 requests when neither is given).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from splitserve.errors import SplitserveError

WORKLOADS = ("synthetic", "shared-prefix", "multi-turn", "trace", "sharegpt")


def _add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    g.add_argument("--model", default=None, help="model name to request (default: the server's only model)")
    g.add_argument("--tokenizer", default=None,
                   help="'smollm2', a model folder or a .gguf file whose tokenizer builds the prompts "
                        "(default: --model)")
    g.add_argument("--api", choices=["completions", "chat"], default="completions",
                   help="/v1/completions or /v1/chat/completions (default: %(default)s)")
    g.add_argument("--prompt-format", choices=["text", "ids"], default="text",
                   help="completions prompts as text or as token ids (default: %(default)s)")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos=true (for servers that reject it; outputs may then end early)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0)")


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (lengths: N, uniform:LO:HI, normal:MEAN:STD or exp:MEAN tokens)")
    g.add_argument("--workload", choices=WORKLOADS, default="synthetic", help="(default: %(default)s)")
    g.add_argument("--input-len", default="256", help="synthetic prompt / multi-turn user turn (default: 256)")
    g.add_argument("--output-len", default="64", help="output tokens asked for (default: 64)")
    g.add_argument("--tenants", type=int, default=4, help="shared-prefix: tenants (default: 4)")
    g.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: shared tokens per tenant (default: 512)")
    g.add_argument("--questions-per-tenant", type=int, default=8, help="shared-prefix (default: 8)")
    g.add_argument("--question-len", default="64", help="shared-prefix: question tokens (default: 64)")
    g.add_argument("--turns", type=int, default=4, help="multi-turn: user turns per session (default: 4)")
    g.add_argument("--think-time", type=float, default=0.0, metavar="S", help="multi-turn: pause between turns")
    g.add_argument("--trace", type=Path, default=None,
                   help="Mooncake trace JSONL (default: $SPLITSERVE_MOONCAKE_TRACE, else the "
                        "conversation trace shipped with splitserve)")
    g.add_argument("--trace-start", type=int, default=0, help="first trace record to replay")
    g.add_argument("--trace-block-tokens", type=int, default=16,
                   help="tokens per 512-token trace block (scales inputs down; default: 16)")
    g.add_argument("--trace-output-scale", type=float, default=None,
                   help="output length factor (default: block tokens / 512)")
    g.add_argument("--trace-max-output", type=int, default=256, help="cap on scaled output lengths")
    g.add_argument("--trace-conversations", type=int, default=None, metavar="K",
                   help="replay only the first K conversations of --trace-min-turns turns or more (records "
                        "sharing their first two blocks), in trace order: the trace's prefix reuse, dense "
                        "(every request of theirs unless --num-requests caps them; default: consecutive records)")
    g.add_argument("--trace-min-turns", type=int, default=3, help="with --trace-conversations (default: 3)")
    g.add_argument("--trace-max-input", type=int, default=None, metavar="N",
                   help="cut longer scaled prompts to their first N tokens, their shared prefix kept "
                        "(e.g. the server's context length less the outputs; default: no cut)")
    g.add_argument("--trace-time-scale", type=float, default=1.0, help="multiply trace timestamps (>1: slower)")
    g.add_argument("--dataset", type=Path, default=None, help="sharegpt: the ShareGPT-style JSON file")
    g.add_argument("--sharegpt-turns", type=int, default=1, help="sharegpt: turns per conversation (default: 1)")
    g.add_argument("--max-input-len", type=int, default=1024,
                   help="sharegpt: skip longer prompts (the trace's: --trace-max-input)")
    g.add_argument("--max-output-len", type=int, default=256, help="sharegpt: cap on output lengths")


def _add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--arrival", choices=["poisson", "constant", "concurrency", "trace"], default=None,
                   help="default: trace for --workload trace, poisson when --rate is given, else concurrency")
    g.add_argument("--rate", type=float, default=None, help="conversations per second (open loop)")
    g.add_argument("--concurrency", type=int, default=4, help="clients in the closed loop (default: 4)")
    g.add_argument("--sweep-rates", default=None, metavar="R1,R2,...",
                   help="run at each rate and find the highest meeting the SLOs")
    g.add_argument("--sweep-keep-going", action="store_true", help="do not stop at the first rate that misses")
    g.add_argument("--slo", default=None, metavar="ttft=S,itl=S[,e2e=S]",
                   help="per-request targets in seconds (or with an ms suffix), for goodput")
    g.add_argument("--slo-attainment", type=float, default=0.9,
                   help="fraction of requests that must meet the SLOs for a rate to pass (default: 0.9)")
    g.add_argument("--num-requests", type=int, default=None, help="requests to send (per rate)")
    g.add_argument("--duration", type=float, default=None, metavar="S", help="stop issuing after S seconds")
    g.add_argument("--request-timeout", type=float, default=300.0, metavar="S", help="per request (default: 300)")
    g.add_argument("--drain-timeout", type=float, default=None, metavar="S",
                   help="after --duration, wait this long for in-flight requests (default: request timeout)")
    g.add_argument("--seed", type=int, default=0)


def build_run_parser(prog: str = "splitserve bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Measure TTFT, inter-token latency, throughput and goodput of an "
                               "OpenAI-compatible endpoint under a workload. "
                               f"Compare two results with `{prog} compare A.json B.json`.")
    _add_target_args(p)
    _add_workload_args(p)
    _add_load_args(p)
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=None,
                   help="folder for result.json / sweep.json and the PNGs (default: ./splitserve-bench/<time>)")
    g.add_argument("--label", default=None, help="name of this run in reports (default: the workload)")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--no-progress", action="store_true")
    return p


def build_compare_parser(prog: str = "splitserve bench compare") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Print every aggregate of two results and their A/B ratio.")
    p.add_argument("a", type=Path, metavar="A.json")
    p.add_argument("b", type=Path, metavar="B.json")
    return p


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise SplitserveError(f"bad --sweep-rates {text!r}: comma-separated numbers") from None
    if not rates or min(rates) <= 0:
        raise SplitserveError("--sweep-rates needs positive rates")
    return rates


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["compare"]:
            return _compare(build_compare_parser().parse_args(argv[1:]))
        return _run(build_run_parser().parse_args(argv))
    except SplitserveError as exc:
        print(f"splitserve bench: error: {exc}", file=sys.stderr)
        return 2


def _compare(args: argparse.Namespace) -> int:
    from rich.console import Console

    from splitserve.loadgen.compare import compare_files

    _, table = compare_files(args.a, args.b)
    Console().print(table)
    return 0


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from splitserve.loadgen.bench import run_once, run_sweep, write_outputs
    from splitserve.loadgen.report import print_run, print_sweep
    from splitserve.loadgen.options import build_spec

    spec = build_spec(args)
    console, err = Console(), Console(stderr=True)
    if args.sweep_rates:
        document = run_sweep(spec, parse_rates(args.sweep_rates), args.slo_attainment,
                             args.sweep_keep_going, err)
        print_sweep(console, document)
    else:
        document = run_once(spec, err)
        print_run(console, document)
    out = args.out or Path("splitserve-bench") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for path in write_outputs(document, out, make_plots=not args.no_plots):
        err.print(f"wrote {path}")
    return 0
