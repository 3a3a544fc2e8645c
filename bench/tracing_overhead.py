"""What tracing costs the frontend's request path: `Frontend.generate` with tracing off and on.

One process, no worker: a stand-in decode worker answers each request with its tokens at once,
so the time measured is the frontend's own work per request (routing, the worker message, one
delta per token with incremental detokenization and the metrics) and, with tracing on, the
spans (llm_request, route, worker_call) handed to the SDK's batch processor and exported over
OTLP/gRPC to a receiver in a child process (splitserve/testing/otlp_collector.py). Modes are
interleaved, each repetition's order alternating, and medians compared (bench/README.md).

    python bench/tracing_overhead.py                     # off and on, 5 repetitions of 2000 requests
    python bench/tracing_overhead.py --modes off --out bench/results/tracing-off.json

`--modes off` also runs on a tree without tracing (it passes no tracer), which is how the
request path before tracing is compared with tracing off: run it on both, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from splitserve.checkpoints.model_source import open_checkpoint
from splitserve.hardware import write_report
from splitserve.proto.v1 import worker_pb2
from splitserve.services.frontend.core import Frontend
from splitserve.services.frontend.generation_request import GenerationRequest
from splitserve.services.frontend.metrics import FrontendMetrics
from splitserve.services.frontend.routing import Route
from splitserve.services.frontend.workers.pool import WorkerPool
from splitserve.services.text.tokenizer import Tokenizer
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.testing.models import build_random_model, random_prompt

PROMPT_TOKENS = 64
# The OTLP receiver, in a process of its own so that its decoding is not counted as the frontend's.
_RECEIVER = """
import sys
from splitserve.testing.otlp_collector import OtlpCollector
c = OtlpCollector.start()
print(c.endpoint, flush=True)
sys.stdin.read()
print(len(c.spans), flush=True)
"""


@dataclass
class StandInWorker:
    """A decode worker that answers at once: one message per token, the last one finished."""

    num_tokens: int
    worker_id: str = "decode-0"
    role: str = "decode"

    async def generate(self, message: worker_pb2.TokenGenerateRequest):
        for i in range(self.num_tokens):
            yield worker_pb2.TokenGenerateResponse(token_ids=[100 + i], finished=i == self.num_tokens - 1,
                                                   finish_reason=2 if i == self.num_tokens - 1 else 0,
                                                   num_prompt_tokens=len(message.token_ids), num_output_tokens=i + 1)


class OneWorkerRouter:
    def __init__(self, worker: StandInWorker) -> None:
        self.route_to = Route(worker, None, "bench")

    def route(self, request, exclude=frozenset()):
        return self.route_to

    def on_first_token(self, request_id: str) -> None:
        pass

    def on_finished(self, request_id: str) -> None:
        pass


def build(tokenizer: Tokenizer, num_tokens: int, tracer) -> Frontend:
    extra = {"tracer": tracer} if tracer is not None else {}      # a tree without tracing has no such argument
    return Frontend(tokenizer, WorkerPool(), OneWorkerRouter(StandInWorker(num_tokens)), FrontendMetrics(),
                    "bench", **extra)


async def run_requests(frontend: Frontend, num_requests: int, num_tokens: int) -> float:
    """Seconds per request, run one after another."""
    prompt = random_prompt(1, PROMPT_TOKENS)
    started = time.perf_counter()
    for i in range(num_requests):
        req = GenerationRequest(f"r{i}", "completions", prompt, SamplingParams(max_tokens=num_tokens))
        async for _ in frontend.generate(req):
            pass
    return (time.perf_counter() - started) / num_requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="off,on", help="comma-separated: off, on (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None, help="JSON report")
    args = parser.parse_args()
    modes = args.modes.split(",")
    folder = tempfile.TemporaryDirectory()
    tokenizer = Tokenizer(open_checkpoint(str(build_random_model("llama", Path(folder.name)))))
    receiver, frontends = None, {}
    for mode in modes:
        tracer = None
        if mode == "on":
            from splitserve.tracing import start_tracer

            receiver = subprocess.Popen([sys.executable, "-c", _RECEIVER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
            tracer = start_tracer("bench-frontend", receiver.stdout.readline().strip())
        frontends[mode] = build(tokenizer, args.tokens, tracer)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for mode in modes:                      # warm-up
        asyncio.run(run_requests(frontends[mode], 200, args.tokens))
    for rep in range(args.reps):
        for mode in (modes if rep % 2 == 0 else modes[::-1]):
            times[mode].append(asyncio.run(run_requests(frontends[mode], args.requests, args.tokens)))
    medians = {m: statistics.median(t) for m, t in times.items()}
    print(f"{'mode':<6} {'µs/request':>11} {'ratio to ' + modes[0]:>14}")
    for mode in modes:
        print(f"{mode:<6} {medians[mode] * 1e6:>11.1f} {medians[mode] / medians[modes[0]]:>14.3f}")
    if receiver is not None:
        frontends["on"].tracer.shutdown()
        received, _ = receiver.communicate("")
        print(f"spans received by the OTLP receiver: {received.strip()}")
    folder.cleanup()
    if args.out:
        write_report(args.out, {"requests": args.requests, "tokens": args.tokens, "reps": args.reps,
                                "seconds_per_request": times, "median_us": {m: v * 1e6 for m, v in medians.items()}})


if __name__ == "__main__":
    main()
