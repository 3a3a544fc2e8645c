"""The queueing model: which constraint sizes each pool, and when no count can meet the SLO."""

from __future__ import annotations

import math

import pytest

from splitserve.services.planner import Binding, PredictedLoad, SizingModel, SloTargets
from splitserve.services.planner.sizing import max_utilisation_for_wait, p90_wait

from .conftest import make_config, make_profile


def _load(rate: float, prompt: float, output: float, **gauges) -> PredictedLoad:
    fields = dict(backlog_tokens=0.0, num_running_decodes=0.0, decode_kv_usage=0.0)
    fields.update(gauges)
    return PredictedLoad(horizon_s=0.0, arrival_rate=rate, prompt_tokens_mean=prompt, prompt_tokens_p90=1.5 * prompt,
                         output_tokens_mean=output, **fields)


def _model(**overrides) -> SizingModel:
    profile = overrides.pop("profile", make_profile())
    return SizingModel.of(profile, make_config(**overrides))


def test_the_p90_wait_is_the_mm1_tail():
    service_s, rho = 0.2, 0.7
    t90 = p90_wait(service_s, rho)
    assert rho * math.exp(-(1 - rho) * t90 / service_s) == pytest.approx(0.1)   # P(W > t90) = 10 %
    assert p90_wait(service_s, 0.05) == 0.0 and p90_wait(service_s, 1.0) == math.inf
    rho_max = max_utilisation_for_wait(service_s, t90)
    assert rho_max == pytest.approx(rho, abs=1e-6)


def test_long_prompts_need_more_prefill_workers_at_the_same_request_rate():
    model = _model()
    short, long = model.prefill(_load(4.0, 512, 64)), model.prefill(_load(4.0, 4096, 64))
    assert long.count > short.count >= 1
    assert long.binding is Binding.TTFT                 # a 6k-token p90 prompt leaves little room for waiting


def test_a_loose_ttft_leaves_the_utilisation_ceiling_binding():
    model = _model(slo=SloTargets(ttft_p90_s=30.0, itl_p90_s=0.05))
    need = model.prefill(_load(10.0, 2048, 64))
    assert need.binding is Binding.UTILISATION
    assert need.count == math.ceil(10.0 * 2048 / (10_000 * 0.8))


def test_a_prompt_longer_than_the_ttft_allows_is_unreachable():
    need = _model(slo=SloTargets(ttft_p90_s=0.5, itl_p90_s=0.05)).prefill(_load(1.0, 8192, 64))
    assert not need.reachable and need.binding is Binding.TTFT
    assert need.count == math.ceil(8192 / (9000 * 0.8))   # sized for the utilisation ceiling only


def test_a_backlog_is_drained_on_top_of_the_arrivals():
    model = _model(backlog_drain_s=10.0)
    calm = model.prefill(_load(2.0, 2048, 64))
    behind = model.prefill(_load(2.0, 2048, 64, backlog_tokens=100_000))
    assert behind.count > calm.count


def test_long_outputs_need_more_decode_workers():
    model = _model()
    assert model.batches.largest_batch_within(0.05) == 53          # t(53) <= 50 ms < t(54) on this profile
    short, long = model.decode(_load(3.0, 64, 64)), model.decode(_load(3.0, 64, 1024))
    assert long.count > short.count and long.binding is Binding.ITL
    assert long.count == math.ceil(3.0 * 1024 / (0.8 * make_profile().decode.at(53)))


def test_decodes_already_running_must_fit_in_itl_batches():
    need = _model().decode(_load(0.1, 64, 64, num_running_decodes=200))
    assert need.count == math.ceil(200 / 53) and need.binding is Binding.ITL


def test_kv_binds_when_memory_runs_out_before_latency():
    observed = _model().decode(_load(0.1, 64, 64, decode_kv_usage=2.5))
    assert observed.binding is Binding.KV and observed.count == math.ceil(2.5 / 0.9)
    small_kv = _model(profile=make_profile(kv_capacity_tokens=20_000)).decode(_load(2.0, 8000, 256))
    assert small_kv.binding is Binding.KV and small_kv.count > _model().decode(_load(2.0, 8000, 256)).count


def test_an_itl_below_one_tokens_time_is_unreachable():
    need = _model(slo=SloTargets(ttft_p90_s=1.0, itl_p90_s=0.01)).decode(_load(1.0, 64, 256))
    assert not need.reachable and need.count == math.ceil(256 / (0.8 * 40))   # batch 1, best effort


def test_aggregated_workers_share_their_time_between_prefill_and_decode():
    model = _model()
    mixed = _load(2.0, 1024, 512)
    joined = model.aggregated(mixed, limit=16)
    split = model.prefill(mixed).count + model.decode(mixed).count
    assert joined.reachable and joined.count < split         # at this mix one pool saves a worker (2 vs 1 + 2)
    assert model.aggregated(mixed, limit=joined.count - 1).count == joined.count   # and no fewer would do
    heavy = model.aggregated(_load(4.0, 2048, 256), limit=16)
    assert heavy.binding is Binding.UTILISATION              # both shares together pass the ceiling below it
    assert model.aggregated(_load(0.0, 0, 0), limit=4).binding is Binding.MIN
    assert model.aggregated(_load(200.0, 4096, 1024), limit=4).count == 5      # none up to the limit suffices


def test_interleaved_prefill_shrinks_the_batch_that_meets_the_itl():
    model = _model()
    decode_only, with_prefill = model.aggregated(_load(3.0, 64, 1024), 16), model.aggregated(_load(3.0, 2048, 1024), 16)
    def batch(detail: str) -> int:
        return int(detail.rsplit("batch <= ", 1)[1])

    assert batch(with_prefill.detail) < batch(decode_only.detail) <= model.batches.largest_batch_within(0.05)
    assert with_prefill.count > decode_only.count
