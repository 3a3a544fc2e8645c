"""Penalties, logit_bias and min_tokens in the sampler, against transformers' logits processors.

One batch of random logits with mixed parameters per row: each row must come out as
transformers' RepetitionPenaltyLogitsProcessor (over prompt + output) plus the OpenAI
presence/frequency formula (over the output only) and the bias would make it, and the
batched sampler must pick, token for token, the argmax of those reference logits.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from splitserve.errors import InvalidRequestError
from splitserve.services.engine.logits_controls import TokenHistory, apply_logits_controls
from splitserve.services.engine.sampler import sample
from splitserve.services.worker_protocol.sampling_params import SamplingParams

VOCAB = 64
EOS = 5


def _reference(row: torch.Tensor, p: SamplingParams, h: TokenHistory) -> torch.Tensor:
    """One row the unbatched way: bias and min_tokens, transformers' repetition rule, OpenAI's
    `logit - count * frequency - (count > 0) * presence` over the output tokens."""
    row = row.clone()
    for t, bias in p.logit_bias.items():
        row[t] += bias
    if h.num_generated < p.min_tokens:
        for t in set(p.stop_token_ids) | ({EOS} if not p.ignore_eos else set()):
            row[t] = float("-inf")
    if p.repetition_penalty != 1.0 and h.token_ids:
        processor = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)
        row = processor(torch.tensor([h.token_ids]), row.unsqueeze(0))[0]
    output = h.token_ids[len(h.token_ids) - h.num_output_tokens:] if h.num_output_tokens else []
    for t in set(output):
        row[t] -= output.count(t) * p.frequency_penalty + p.presence_penalty
    return row


def _random_case(rng: random.Random, i: int) -> tuple[SamplingParams, TokenHistory]:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
    output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 10))]
    prior = rng.randrange(0, len(prompt) + 1) if i % 3 == 0 else 0     # a migrated request
    params = SamplingParams(
        max_tokens=32,
        presence_penalty=rng.choice([0.0, 0.5, -1.5, 2.0]),
        frequency_penalty=rng.choice([0.0, 0.3, -0.7, 2.0]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.7, 2.5]),
        logit_bias={rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randrange(0, 3))},
        min_tokens=rng.choice([0, 0, 5, 20]), stop_token_ids=rng.choice([[], [7, 9]]),
        ignore_eos=rng.random() < 0.2, num_prior_output_tokens=prior)
    params.validate()
    history = TokenHistory(prompt + output, prior + len(output), len(output))
    return params, history


def test_batched_controls_match_transformers_row_by_row():
    rng = random.Random(0)
    torch.manual_seed(0)
    logits = torch.randn(48, VOCAB) * 4
    cases = [_random_case(rng, i) for i in range(48)]
    params = [p for p, _ in cases]
    histories = [h for _, h in cases]
    controlled = apply_logits_controls(logits, params, histories, {EOS})
    expected = torch.stack([_reference(logits[i], p, h) for i, (p, h) in enumerate(cases)])
    torch.testing.assert_close(controlled, expected, rtol=1e-6, atol=1e-5)
    greedy = sample(logits, params, [None] * len(params), histories, {EOS})
    assert [t.token_id for t in greedy] == expected.argmax(dim=-1).tolist()
    assert sum(e != r for e, r in zip(expected.argmax(-1).tolist(), logits.argmax(-1).tolist())) > 10


def test_raw_logits_untouched_and_logprobs_are_the_models():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    before = logits.clone()
    params = SamplingParams(logprobs=1, logit_bias={1: -100.0})
    out = sample(logits, [params], [None], [TokenHistory([], 0, 0)])
    assert out[0].token_id == 3
    assert torch.equal(logits, before)
    assert out[0].logprob == pytest.approx(float(torch.log_softmax(before, -1)[0, 3]))


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[9.0, 8.0, 1.0, 0.0]])          # EOS 0 then stop token 1 lead
    params = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[1])
    early = sample(logits, [params], [None], [TokenHistory([3, 3], 1, 1)], {0})
    done = sample(logits, [params], [None], [TokenHistory([3, 3, 3], 2, 2)], {0})
    assert early[0].token_id == 2 and done[0].token_id == 0
    ignoring = SamplingParams(max_tokens=8, min_tokens=2, ignore_eos=True)
    assert sample(logits, [ignoring], [None], [TokenHistory([3], 0, 0)], {0})[0].token_id == 0


def test_sampled_rows_draw_from_controlled_distribution():
    logits = torch.tensor([[0.0, 10.0, 0.0, 0.0]])
    params = SamplingParams(temperature=1.0, logit_bias={1: -100.0, 2: 50.0})
    gens = [torch.Generator().manual_seed(s) for s in range(20)]
    assert {sample(logits, [params], [g], [TokenHistory([], 0, 0)])[0].token_id for g in gens} == {2}


def test_a_vanishing_repetition_penalty_keeps_logits_finite_and_sampling_alive():
    """5e-324 is > 0 (accepted) but 0 in float32: the seen token's positive logit would be inf
    and the softmax NaN, which failed the engine step (found by the schema fuzzer)."""
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5]])
    params = SamplingParams(temperature=1.0, repetition_penalty=5e-324)
    controlled = apply_logits_controls(logits, [params], [TokenHistory([1, 2], 0, 0)], set())
    assert torch.isfinite(controlled).all() and controlled[0, 1] == torch.finfo(torch.float32).max
    gens = [torch.Generator().manual_seed(s) for s in range(10)]
    assert {sample(logits, [params], [g], [TokenHistory([1, 2], 0, 0)])[0].token_id for g in gens} == {1}


@pytest.mark.parametrize("change", [
    dict(presence_penalty=2.5), dict(frequency_penalty=-2.01), dict(repetition_penalty=0.0),
    dict(min_tokens=17), dict(min_tokens=-1), dict(logit_bias={-1: 1.0}), dict(logit_bias={3: float("nan")}),
    dict(num_prior_output_tokens=-1), dict(stop_token_ids=[-2]),
])
def test_out_of_range_controls_are_refused(change):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**change).validate()
