"""Beam search's bookkeeping (services/frontend/beam_search.py) on a made-up language model whose
every distribution is known, against brute force over all its continuations; the step requests
it sends; which request fields go with use_beam_search (http/beam_search_api.py).

The served beam search, against the model itself, is tests/integration/serving/test_beam_search.py.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random

import pytest

from splitserve.proto.v1 import common_pb2
from splitserve.services.frontend.beam_search import (BeamSearch, BeamSearchParams, beam_score, beam_width_problem,
                                                      run_beam_search)
from splitserve.services.frontend.core import Delta
from splitserve.services.frontend.errors import APIError
from splitserve.services.frontend.generation_request import GenerationRequest
from splitserve.services.frontend.http.beam_search_api import STREAMING_REFUSED, beam_search_params
from splitserve.services.frontend.http.generation import parse_body
from splitserve.services.frontend.http.protocol import ChatCompletionRequest, CompletionRequest
from splitserve.services.worker_protocol.sampling_params import SamplingParams

VOCAB, EOS = 4, 2
PROMPT = [1, 3, 0]


def next_logprobs(token_ids: list[int]) -> list[float]:
    """The made-up model: a distribution over VOCAB tokens seeded by the sequence so far."""
    rng = random.Random(str(token_ids))
    logits = [rng.gauss(0.0, 1.5) for _ in range(VOCAB)]
    norm = math.log(sum(math.exp(x) for x in logits))
    return [x - norm for x in logits]


def step_entry(token_ids: list[int], num: int) -> common_pb2.TokenLogprob:
    """What a worker answers for one greedy token with `num` logprobs."""
    lps = next_logprobs(token_ids)
    order = sorted(range(VOCAB), key=lambda t: -lps[t])[:num]
    return common_pb2.TokenLogprob(token_id=order[0], logprob=lps[order[0]],
                                   top=[common_pb2.TopLogprob(token_id=t, logprob=lps[t]) for t in order])


def search(params: BeamSearchParams, prompt=PROMPT) -> BeamSearch:
    bs = BeamSearch(params, list(prompt), EOS)
    while not bs.done:
        bs.advance([step_entry(prompt + b.token_ids, params.num_step_logprobs) for b in bs.live])
    return bs


def brute_force(max_tokens: int, width: int, length_penalty: float) -> list[tuple[list[int], float]]:
    """Every continuation (EOS only last, kept in the output) scored; the `width` best."""
    sequences = []
    for length in range(1, max_tokens + 1):
        for body in itertools.product([t for t in range(VOCAB) if t != EOS], repeat=length - 1):
            for last in ([EOS] if length < max_tokens else list(range(VOCAB))):
                tokens = [*body, last]
                cum = sum(next_logprobs(PROMPT + tokens[:i])[t] for i, t in enumerate(tokens))
                sequences.append((tokens, cum))
    def score(s: tuple[list[int], float]) -> float:
        return beam_score(s[0][-1], len(PROMPT) + len(s[0]), s[1], EOS, length_penalty)
    return sorted(sequences, key=score, reverse=True)[:width]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_a_beam_as_wide_as_every_path_finds_the_brute_force_best(length_penalty):
    # 3 non-EOS tokens, 2 steps: at most 9 live candidates, all kept by a width of 9.
    params = BeamSearchParams(beam_width=9, max_tokens=2, length_penalty=length_penalty,
                              include_stop_str_in_output=True)
    beams = search(params).best()
    expected = brute_force(2, 9, length_penalty)
    assert [b.token_ids for b in beams] == [tokens for tokens, _ in expected]
    assert [b.cum_logprob for b in beams] == pytest.approx([cum for _, cum in expected], abs=1e-12)
    assert [b.finish_reason for b in beams] == ["stop" if t[-1] == EOS else "length" for t, _ in expected]


def test_a_narrow_beam_keeps_the_best_candidates_of_each_step():
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    bs = BeamSearch(params, list(PROMPT), EOS)
    bs.advance([step_entry(PROMPT, 4)])
    first = next_logprobs(PROMPT)
    kept = sorted((t for t in range(VOCAB) if t != EOS), key=lambda t: -first[t])[:2]
    assert [b.token_ids for b in bs.live] == [[t] for t in kept]
    assert [b.cum_logprob for b in bs.live] == [first[t] for t in kept]
    assert [b.finish_reason for b in bs.completed] == ["stop"] and bs.completed[0].token_ids == []
    assert bs.completed[0].cum_logprob == first[EOS]          # the EOS's logprob counts, its token is left out
    assert [lp.token_id for lp in bs.completed[0].logprobs] == [EOS] and bs.completed[0].output_logprobs == []


def test_ignore_eos_keeps_eos_as_a_token_and_every_beam_runs_to_max_tokens():
    beams = search(BeamSearchParams(beam_width=3, max_tokens=3, ignore_eos=True)).best()
    assert len(beams) == 3 and all(len(b.token_ids) == 3 and b.finish_reason == "length" for b in beams)


def test_the_length_penalty_ranks_as_vllm_does():
    # vLLM's score counts the prompt, and leaves a final EOS out of the length.
    assert beam_score(5, 10, -3.0, EOS, 1.0) == -0.3
    assert beam_score(EOS, 10, -3.0, EOS, 1.0) == pytest.approx(-3.0 / 9)
    assert beam_score(5, 10, -3.0, EOS, 0.0) == -3.0
    short = search(BeamSearchParams(beam_width=4, max_tokens=3, length_penalty=0.0)).best()
    long = search(BeamSearchParams(beam_width=4, max_tokens=3, length_penalty=4.0)).best()
    assert [b.cum_logprob for b in short] == sorted((b.cum_logprob for b in short), reverse=True)
    assert len(long[0].token_ids) >= len(short[0].token_ids)


def test_the_response_shows_only_the_logprobs_asked_for():
    bs = search(BeamSearchParams(beam_width=2, max_tokens=2, num_top_logprobs=1))
    assert all(len(lp.top) == 1 and lp.rank >= 1 for b in bs.best() for lp in b.logprobs)
    assert BeamSearchParams(beam_width=2, max_tokens=1, num_top_logprobs=7).num_step_logprobs == 7


class FakeFrontend:
    """A StepRunner that answers from the made-up model and records what it was asked."""

    def __init__(self, fail_at_step: int | None = None):
        self.reqs: list[GenerationRequest] = []
        self.fail_at_step = fail_at_step

    async def generate(self, req: GenerationRequest):
        self.reqs.append(req)
        if self.fail_at_step is not None and f"-beam{self.fail_at_step}." in req.request_id:
            raise APIError(503, "no worker is ready", type="service_unavailable")
        await asyncio.sleep(0)
        entry = step_entry(req.prompt_ids, req.params.logprobs)
        yield Delta("", [entry.token_id], [entry], "length", len(req.prompt_ids), 2, 1)


def test_run_beam_search_sends_one_greedy_token_per_beam_and_step():
    fe = FakeFrontend()
    req = GenerationRequest("cmpl-1", "completions", list(PROMPT), SamplingParams(max_tokens=3, cache_salt="s"))
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    result = asyncio.run(run_beam_search(fe.generate, req, params, EOS))
    assert [b.token_ids for b in result.beams] == [b.token_ids for b in search(params).best()]
    assert (result.num_prompt_tokens, result.num_cached_tokens) == (3, 2)
    assert fe.reqs[0].request_id == "cmpl-1-beam0.0" and fe.reqs[0].prompt_ids == PROMPT
    assert {(r.params.max_tokens, r.params.temperature, r.params.logprobs, r.params.cache_salt)
            for r in fe.reqs} == {(1, 0.0, 4, "s")}
    assert sorted(r.request_id for r in fe.reqs if "-beam1." in r.request_id) == ["cmpl-1-beam1.0", "cmpl-1-beam1.1"]


def test_a_step_that_fails_fails_the_search_with_its_error():
    req = GenerationRequest("cmpl-2", "chat", list(PROMPT), SamplingParams(max_tokens=4))
    with pytest.raises(APIError) as info:
        asyncio.run(run_beam_search(FakeFrontend(fail_at_step=1).generate, req,
                                    BeamSearchParams(beam_width=2, max_tokens=4), EOS))
    assert info.value.status == 503


# ---- which requests may use beam search ------------------------------------------------------------------

def completion(**fields) -> bytes:
    import json
    return json.dumps({"model": "m", "prompt": [1, 2], "use_beam_search": True, **fields}).encode()


def chat(**fields) -> bytes:
    import json
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "use_beam_search": True,
                       **fields}).encode()


@pytest.mark.parametrize("fields, param", [
    ({"stop": ["x"]}, "stop"), ({"stop_token_ids": [5]}, "stop_token_ids"), ({"top_p": 0.5}, "top_p"),
    ({"top_k": 3}, "top_k"), ({"min_p": 0.1}, "min_p"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"), ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"min_tokens": 2}, "min_tokens"), ({"bad_words": ["x"]}, "bad_words"),
    ({"allowed_token_ids": [3]}, "allowed_token_ids"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"guided_regex": "a+"}, "guided_regex"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"n": 2, "best_of": 3}, "best_of"), ({"echo": True, "logprobs": 1}, "echo"),
])
def test_fields_beam_search_would_pass_over_are_refused_by_name(fields, param):
    with pytest.raises(APIError) as info:
        parse_body(completion(**fields), CompletionRequest)
    assert (info.value.status, info.value.param) == (400, param), info.value.message
    assert "beam search" in info.value.message or "use_beam_search" in info.value.message


def test_the_beam_width_is_bounded_by_the_workers_max_logprobs():
    # each step asks for 2 x width logprobs: 10 beams at vLLM's default --max-logprobs of 20
    assert beam_width_problem(10, 20) is None and beam_width_problem(50, 100) is None
    assert "at most 10" in beam_width_problem(11, 20) and "--max-logprobs of 20" in beam_width_problem(11, 20)
    assert "at most 2" in beam_width_problem(3, 5)
    body = parse_body(completion(n=11), CompletionRequest)
    with pytest.raises(APIError) as info:
        beam_search_params(body, max_tokens=8, num_top_logprobs=0, max_logprobs=20)
    assert (info.value.status, info.value.param) == (400, "n")
    assert beam_search_params(body, max_tokens=8, num_top_logprobs=0, max_logprobs=32000).beam_width == 11


def test_streaming_completions_are_refused_with_vllms_words_and_chat_streams():
    with pytest.raises(APIError) as info:
        parse_body(completion(stream=True), CompletionRequest)
    assert (info.value.status, info.value.param, info.value.message) == (400, "stream", STREAMING_REFUSED)
    body = parse_body(chat(stream=True, n=3, temperature=0.7, top_p=1.0, seed=4, length_penalty=0.5,
                           logprobs=True, top_logprobs=2, include_stop_str_in_output=True), ChatCompletionRequest)
    assert body.use_beam_search and body.n == 3


def test_length_penalty_without_beam_search_is_refused():
    with pytest.raises(APIError) as info:
        parse_body(completion(use_beam_search=False, length_penalty=0.5), CompletionRequest)
    assert info.value.param == "length_penalty" and "use_beam_search" in info.value.message
