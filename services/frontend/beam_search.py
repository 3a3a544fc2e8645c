"""Beam search in the frontend, over the workers' logprobs (vLLM's `use_beam_search`).

vLLM's OpenAI server runs beam search above its engine (`BeamSearchOnlineMixin.beam_search`)
and so does splitserve, with the same rules, so that a client gets the beams vLLM would give:

- every step, each live beam is one worker request: the prompt plus the beam's tokens,
  `max_tokens` 1, greedy, `logprobs` 2 x beam_width. The prefix cache makes these cheap:
  a worker that served the beam's previous step computes only the tokens after its last
  full cached KV block (the KV-aware router sends the step there);
- a beam's candidates are those 2 x beam_width most likely next tokens, each scored by the
  beam's cumulative logprob plus its own. A candidate that is EOS (unless ignore_eos)
  finishes its beam (finish_reason "stop"; the EOS token stays in the output only with
  include_stop_str_in_output); the `beam_width` best other candidates, over all beams,
  are the next step's beams (ties: the earlier beam, then the more likely token);
- after `max_tokens` steps the live beams finish with "length"; every finished beam is
  ranked by `beam_score` (the cumulative logprob over the length, prompt included, to the
  power `length_penalty`; a final EOS is not counted) and the `beam_width` best are the
  result, best first.

The logprobs are the model's own (the workers' raw logprobs), so temperature does not change
the result here. vLLM samples each step's token at the request's temperature and adds it to
the candidates when it is not among the most likely; such a token can never displace one of
them, so the two differ only where that token is EOS, which then ends a low-scored beam.
Stop strings and stop_token_ids play no part, as in vLLM (the request refuses them).

`BeamSearch` is that bookkeeping, pure; `run_beam_search` drives it over a `StepRunner`
(the frontend's `generate`, which routes each step and continues it on another worker if
its worker fails); `search_prompts` and `beam_deltas` are what the HTTP and gRPC APIs call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field, replace

from splitserve.proto.v1 import common_pb2
from splitserve.services.text.tokenizer import Tokenizer
from splitserve.services.worker_protocol.sampling_params import SamplingParams

from splitserve.services.frontend.core import Delta
from splitserve.services.frontend.errors import APIError
from splitserve.services.frontend.generation_request import GenerationRequest



def max_beam_width(max_logprobs: int) -> int:
    """The widest beam the workers can serve: each step asks for 2 x beam_width logprobs, and
    they serve up to their --max-logprobs (`Frontend.max_logprobs`; 20 by default: 10 beams)."""
    return max_logprobs // 2


def beam_width_problem(width: int, max_logprobs: int) -> str | None:
    limit = max_beam_width(max_logprobs)
    if width <= limit:
        return None
    return (f"beam search with a width of {width} would ask the workers for {2 * width} logprobs per step "
            f"(2 x the width), more than their --max-logprobs of {max_logprobs}: the width must be at most {limit}")


@dataclass(slots=True, frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams, as far as they change the result."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    num_top_logprobs: int = 0        # alternatives the response shows per token

    @property
    def num_step_logprobs(self) -> int:
        return max(2 * self.beam_width, self.num_top_logprobs)


@dataclass(slots=True)
class Beam:
    token_ids: list[int]                                 # the output, without the prompt
    logprobs: list[common_pb2.TokenLogprob]              # one per step, the EOS step's included
    cum_logprob: float = 0.0
    finish_reason: str | None = None

    @property
    def output_logprobs(self) -> list[common_pb2.TokenLogprob]:
        """The logprobs of `token_ids` (an EOS left out of the output has its entry left out)."""
        return self.logprobs[:len(self.token_ids)]


def beam_score(last_token_id: int, num_tokens: int, cum_logprob: float, eos_token_id: int | None,
               length_penalty: float) -> float:
    """vLLM's get_beam_search_score: `num_tokens` counts the prompt; a final EOS is not counted."""
    seq_len = num_tokens - 1 if last_token_id == eos_token_id else num_tokens
    return cum_logprob / (seq_len ** length_penalty)


@dataclass(slots=True)
class BeamSearch:
    """One prompt's beam search: `advance` with each live beam's next-token logprobs, until
    `done`; then `best()`."""

    params: BeamSearchParams
    prompt_ids: list[int]
    eos_token_id: int | None
    live: list[Beam] = field(default_factory=list)
    completed: list[Beam] = field(default_factory=list)
    num_steps: int = 0

    def __post_init__(self) -> None:
        self.live = [Beam([], [])]

    @property
    def done(self) -> bool:
        return not self.live or self.num_steps >= self.params.max_tokens

    def advance(self, steps: list[common_pb2.TokenLogprob]) -> None:
        """`steps[i]`: beam i's next-token entry, whose `top` holds the most likely tokens."""
        assert len(steps) == len(self.live) and not self.done
        candidates: list[tuple[float, int, int, int]] = []      # (-score, beam, rank, token)
        num_candidates = 2 * self.params.beam_width
        for b, (beam, step) in enumerate(zip(self.live, steps)):
            for rank, top in enumerate(step.top[:num_candidates]):
                cum = beam.cum_logprob + top.logprob
                if top.token_id == self.eos_token_id and not self.params.ignore_eos:
                    kept = [top.token_id] if self.params.include_stop_str_in_output else []
                    self.completed.append(Beam(beam.token_ids + kept, beam.logprobs + [self._entry(step, rank)],
                                               cum, "stop"))
                else:
                    candidates.append((-cum, b, rank, top.token_id))
        candidates.sort()
        self.live = [Beam(self.live[b].token_ids + [token_id],
                          self.live[b].logprobs + [self._entry(steps[b], rank)], -neg_cum)
                     for neg_cum, b, rank, token_id in candidates[:self.params.beam_width]]
        self.num_steps += 1

    def best(self) -> list[Beam]:
        """The beam_width best finished beams, best first (live ones finish with "length")."""
        finished = self.completed + [Beam(b.token_ids, b.logprobs, b.cum_logprob, "length") for b in self.live]
        ranked = sorted(finished, key=self._score, reverse=True)
        return ranked[:self.params.beam_width]

    def _entry(self, step: common_pb2.TokenLogprob, rank: int) -> common_pb2.TokenLogprob:
        """The logprob entry of the token at `rank` among the step's most likely, with the
        alternatives the response shows."""
        top = step.top[rank]
        return common_pb2.TokenLogprob(token_id=top.token_id, logprob=top.logprob, rank=rank + 1,
                                       top=step.top[:self.params.num_top_logprobs])

    def _score(self, beam: Beam) -> float:
        tokens = self.prompt_ids + beam.token_ids
        return beam_score(tokens[-1], len(tokens), beam.cum_logprob, self.eos_token_id, self.params.length_penalty)


StepRunner = Callable[[GenerationRequest], AsyncIterator[Delta]]


@dataclass(slots=True)
class BeamSearchResult:
    beams: list[Beam]
    num_prompt_tokens: int
    num_cached_tokens: int          # the first step's: the prompt's tokens a worker had cached


async def run_beam_search(generate: StepRunner, req: GenerationRequest, params: BeamSearchParams,
                          eos_token_id: int | None) -> BeamSearchResult:
    """Beam search for `req`'s prompt: each step's beams run concurrently, as requests of their
    own (ids `<request_id>-beam<step>.<beam>`); a step that fails fails the search."""
    search = BeamSearch(params, req.prompt_ids, eos_token_id)
    step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=params.num_step_logprobs,
                                 cache_salt=req.params.cache_salt)
    num_cached_tokens = 0
    while not search.done:
        step_reqs = [GenerationRequest(f"{req.request_id}-beam{search.num_steps}.{i}", req.api,
                                       req.prompt_ids + beam.token_ids, step_params,
                                       skip_special_tokens=req.skip_special_tokens)
                     for i, beam in enumerate(search.live)]
        lasts = await _all_or_first_failure([_last_delta(generate(r)) for r in step_reqs])
        if search.num_steps == 0:
            num_cached_tokens = lasts[0].num_cached_tokens
        search.advance([d.logprobs[-1] for d in lasts])
    return BeamSearchResult(search.best(), len(req.prompt_ids), num_cached_tokens)


async def _all_or_first_failure(coroutines: list[Coroutine]) -> list:
    """The coroutines' results, run concurrently; the first failure cancels the rest and is raised."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coroutines]
    except BaseExceptionGroup as failures:
        raise failures.exceptions[0] from None
    return [t.result() for t in tasks]


async def _last_delta(deltas: AsyncIterator[Delta]) -> Delta:
    """A step's last delta: the one holding its token."""
    last = None
    try:
        async for delta in deltas:
            if delta.logprobs:
                last = delta
    finally:
        await deltas.aclose()
    if last is None:
        raise APIError(502, "a beam search step ended without a token", type="server_error")
    return last


async def search_prompts(generate: StepRunner, gens: list[GenerationRequest], params: BeamSearchParams,
                         eos_token_id: int | None) -> list[BeamSearchResult]:
    """One beam search per prompt (each with its own max_tokens), concurrently; the first failure
    cancels the others."""
    return await _all_or_first_failure([run_beam_search(generate, g, replace(params, max_tokens=g.params.max_tokens),
                                                        eos_token_id) for g in gens])


def eos_token_id(tokenizer: Tokenizer) -> int | None:
    """The token that ends a beam (vLLM: the tokenizer's eos_token_id)."""
    return min(tokenizer.eos_token_ids, default=None)


def beam_deltas(result: BeamSearchResult, tokenizer: Tokenizer, skip_special_tokens: bool) -> list[Delta]:
    """Each beam, best first, as the one finished delta of its choice. Its text leaves out a final
    EOS (vLLM's), its tokens and logprobs keep it with include_stop_str_in_output."""
    deltas = []
    for beam in result.beams:
        text_ids = beam.token_ids[:-1] if beam.finish_reason == "stop" and beam.token_ids \
            and beam.token_ids[-1] in tokenizer.eos_token_ids else beam.token_ids
        deltas.append(Delta(tokenizer.decode(text_ids, skip_special_tokens), list(beam.token_ids),
                            beam.output_logprobs, beam.finish_reason, result.num_prompt_tokens,
                            result.num_cached_tokens, len(beam.token_ids)))
    return deltas
