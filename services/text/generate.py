"""Offline text generation: an in-process engine's tokens read the way the frontend reads them.

`splitserve generate`, benchmarks and tests run prompts to completion on an
engine in their own process. The engine gives token ids only (it stops on EOS,
stop token ids, max_tokens and the context limit); this adds what the frontend
adds on top of a worker's stream: the text, through the same StopChecker, so
stop strings are cut exactly as the serving stack cuts them, and an abort of
the engine's request when a stop string ends it (the frontend closes the worker
stream for the same reason).

Torch-free: the engine is anything with `tokenizer`, `add_request`, `step`,
`abort` and `has_unfinished` (LLMEngine is one).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol

from splitserve.services.text.stop_checker import StopChecker
from splitserve.services.text.tokenizer import Tokenizer
from splitserve.services.worker_protocol.outputs import FinishReason, RequestOutput, SampledToken
from splitserve.services.worker_protocol.sampling_params import SamplingParams

_batches = itertools.count()


class StepEngine(Protocol):
    tokenizer: Tokenizer

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> bool: ...

    def has_unfinished(self) -> bool: ...


@dataclass(slots=True)
class TextResult:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    logprobs: list[SampledToken] = field(default_factory=list)


@dataclass(slots=True)
class _Run:
    result: TextResult
    checker: StopChecker


def generate_text(engine: StepEngine, prompts: list[list[int]] | list[str],
                  params: SamplingParams | list[SamplingParams]) -> list[TextResult]:
    """Run `prompts` (token ids, or text to encode) to completion; results in prompt order."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    batch = next(_batches)
    runs: dict[str, _Run] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
        ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request_id = f"text-{batch}-{i}"
        engine.add_request(request_id, ids, p)
        runs[request_id] = _Run(TextResult(request_id, [], "", None, len(ids)), StopChecker(engine.tokenizer, p, ids))
    results = [run.result for run in runs.values()]
    while runs and engine.has_unfinished():
        for out in engine.step():
            run = runs.get(out.request_id)
            if run is None:
                continue   # a request added by someone else
            if _advance(run, out):
                del runs[out.request_id]
                if not out.finished:        # a stop string ended it: the engine would go on
                    engine.abort(out.request_id)
    return results


def _advance(run: _Run, out: RequestOutput) -> bool:
    """Add one engine output to the result; True when the request has ended."""
    r = run.result
    token_ids, logprobs = out.new_token_ids, out.logprobs
    reason = None
    for i, token_id in enumerate(token_ids):
        if run.checker.add(token_id):
            reason = FinishReason.STOP
            token_ids, logprobs = token_ids[:i + 1], logprobs[:i + 1]
            break
    r.token_ids.extend(token_ids)
    r.logprobs.extend(logprobs)
    r.num_prompt_tokens, r.num_cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
    if reason is None and out.finished:
        reason = out.finish_reason
    if reason is not None:
        run.checker.finish()
        r.finish_reason = reason
    r.text += run.checker.take_text()
    return reason is not None
