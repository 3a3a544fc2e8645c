"""Sampling on hand-made logits with known answers."""

from __future__ import annotations

import math

import pytest
import torch

from splitserve.errors import InvalidRequestError
from splitserve.services.engine.sampler import sample
from splitserve.services.worker_protocol.sampling_params import SamplingParams

LOGITS = torch.tensor([[0.0, 3.0, 1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_greedy_takes_the_argmax():
    out = sample(LOGITS, [SamplingParams(), SamplingParams()], [None, None])
    assert [t.token_id for t in out] == [1, 0]


def test_seeded_draws_repeat_and_depend_on_the_seed():
    params = [SamplingParams(temperature=5.0)] * 2
    draws = lambda seed: [sample(LOGITS, params, [gen(seed), gen(seed + 1)])[0].token_id for _ in range(1)]  # noqa: E731
    runs_a = [sample(LOGITS[:1], params[:1], [g])[0].token_id for g in [gen(1)] for _ in range(30)]
    runs_b = [sample(LOGITS[:1], params[:1], [g])[0].token_id for g in [gen(1)] for _ in range(30)]
    assert runs_a == runs_b and len(set(runs_a)) > 1
    assert draws(3) == draws(3)


def test_top_k_top_p_and_min_p_restrict_the_support():
    row = LOGITS[:1]
    for params in (SamplingParams(temperature=1.0, top_k=2),
                   SamplingParams(temperature=1.0, top_p=0.6),
                   SamplingParams(temperature=1.0, min_p=0.8)):
        seen = {sample(row, [params], [gen(i)])[0].token_id for i in range(60)}
        assert seen <= {1, 3}, params
        assert seen == {1, 3}, params
    only_top = {sample(row, [SamplingParams(temperature=1.0, top_p=0.01)], [gen(i)])[0].token_id
                for i in range(20)}
    assert only_top == {1}


def test_logprobs_are_those_of_the_unfiltered_distribution():
    [out] = sample(LOGITS[:1], [SamplingParams(logprobs=2, top_k=1, temperature=0.5)], [gen(0)])
    expected = torch.log_softmax(LOGITS[0], -1)
    assert out.token_id == 1
    assert out.logprob == pytest.approx(float(expected[1]))
    assert list(out.top_logprobs) == [1, 3]
    assert sum(math.exp(v) for v in torch.log_softmax(LOGITS[0], -1).tolist()) == pytest.approx(1.0)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=0), SamplingParams(top_k=-1),
                                    SamplingParams(min_p=2.0), SamplingParams(logprobs=-1),
                                    SamplingParams(stop=[""])])
def test_invalid_parameters_are_rejected(params):
    with pytest.raises(InvalidRequestError):
        params.validate()


def test_more_logprobs_than_the_vocabulary_has_gives_every_token():
    """A request may ask for more alternatives than a tiny vocabulary holds (beam search asks for
    2 x its width): it gets them all, most likely first, and the batch is not failed."""
    [out] = sample(LOGITS[:1], [SamplingParams(logprobs=20)], [None])
    assert list(out.top_logprobs) == [1, 3, 2, 0]
