"""Seeded sampling can be migrated: a request continued elsewhere from its prompt, the tokens
it already produced and the number of draws its generator made (SamplingParams.num_prior_draws)
samples exactly what the uninterrupted request samples."""

from __future__ import annotations

import pytest
import torch

from splitserve.services.engine.sampler import skip_draws
from splitserve.services.worker_protocol.sampling_params import SamplingParams

PROMPT = [1, 415, 2936, 9060, 285, 1142, 28705]


def _params(max_tokens: int, num_prior_draws: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=50, seed=42, ignore_eos=True,
                          num_prior_draws=num_prior_draws)


@pytest.mark.parametrize("cut", [1, 7])
def test_resumed_seeded_request_continues_the_same_random_stream(engine, cut):
    [whole] = engine.generate([PROMPT], _params(16))
    [resumed] = engine.generate([PROMPT + whole.token_ids[:cut]], _params(16 - cut, num_prior_draws=cut))
    [restarted] = engine.generate([PROMPT + whole.token_ids[:cut]], _params(16 - cut))
    assert whole.token_ids[:cut] + resumed.token_ids == whole.token_ids
    assert restarted.token_ids != resumed.token_ids      # without the skip, the stream would differ
    assert engine.pool.num_used_blocks == 0


def test_remote_prefill_reservation_skips_the_prefill_workers_draw(engine):
    """The prefill worker samples the first token with draw 0, so the decode side's generator
    starts at draw 1: a disaggregated seeded request samples what an aggregated one does."""
    [first] = engine.generate([PROMPT], _params(1))
    [whole] = engine.generate([PROMPT], _params(6))
    assert first.token_ids == whole.token_ids[:1]
    assert engine.reserve_remote_prefill("r", PROMPT, _params(6)) is not None
    expected = torch.Generator().manual_seed(42)
    skip_draws(expected, 1, engine.model_config.vocab_size)
    assert torch.equal(engine.scheduler.remote["r"].generator.get_state(), expected.get_state())
    engine.cancel_remote_prefill("r")
    assert engine.pool.num_used_blocks == 0
