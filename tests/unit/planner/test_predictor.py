"""LoadPredictor: the level follows a step at once, a ramp is extrapolated, a step or noise is not."""

from __future__ import annotations

import pytest

from splitserve.services.planner import LoadPredictor, MetricsSample, ReplicaCounts, WorkerLoadSample

REPLICAS = ReplicaCounts.of_pools(1, 1)


def _series(arrivals: list[int], prompt: float = 1000, output: float = 100) -> list[MetricsSample]:
    return [MetricsSample(timestamp=10.0 * (i + 1), interval_s=10.0, num_arrivals=n, prompt_tokens_mean=prompt,
                          prompt_tokens_p90=2 * prompt, output_tokens_mean=output, replicas=REPLICAS)
            for i, n in enumerate(arrivals)]


def test_a_step_up_is_followed_at_once_and_a_step_down_slowly():
    predictor = LoadPredictor(window_s=60.0, ewma_alpha=0.5)
    assert predictor.predict(_series([10] * 6 + [50])).arrival_rate == pytest.approx(5.0)
    down = predictor.predict(_series([50] * 6 + [10]))
    assert 1.0 < down.arrival_rate < 5.0 and down.arrival_rate == pytest.approx(3.0)   # EWMA halfway
    assert down.trend_per_s == 0.0


def test_a_ramp_is_extrapolated_to_the_horizon_but_a_step_is_not():
    predictor = LoadPredictor(window_s=60.0, dead_band=0.15)
    ramp = _series([10, 15, 22, 33, 50, 75])                   # x1.5 per interval
    now, ahead = predictor.predict(ramp), predictor.predict(ramp, horizon_s=30.0)
    assert now.trend_per_s > 0 and ahead.arrival_rate == pytest.approx(now.arrival_rate + 30.0 * now.trend_per_s)
    assert ahead.horizon_s == 30.0
    step = _series([10, 10, 10, 50, 50, 50])
    assert predictor.predict(step, horizon_s=30.0).arrival_rate == pytest.approx(5.0)


def test_noise_within_the_dead_band_is_no_trend():
    predictor = LoadPredictor(window_s=60.0, dead_band=0.15)
    noisy = _series([87, 87, 113, 87, 113, 113])              # 113 / 87 < (1 + 0.15) / (1 - 0.15)
    assert predictor.predict(noisy, horizon_s=600.0).trend_per_s == 0.0


def test_the_length_mix_is_weighted_by_arrivals_and_the_p90_is_the_window_peak():
    samples = _series([30], prompt=1000, output=100) + _series([10], prompt=3000, output=500)
    samples[1] = MetricsSample(timestamp=20.0, interval_s=10.0, num_arrivals=10, prompt_tokens_mean=3000,
                               prompt_tokens_p90=4000, output_tokens_mean=500, replicas=REPLICAS)
    load = LoadPredictor().predict(samples)
    assert load.prompt_tokens_mean == pytest.approx(1500.0) and load.output_tokens_mean == pytest.approx(200.0)
    assert load.prompt_tokens_p90 == 4000
    assert load.prefill_tokens_per_s == pytest.approx(load.arrival_rate * 1500.0)


def test_a_window_without_arrivals_keeps_the_last_lengths_seen():
    samples = _series([20], prompt=777, output=55) + [
        MetricsSample(timestamp=100.0 + 10 * i, interval_s=10.0, num_arrivals=0, prompt_tokens_mean=0,
                      prompt_tokens_p90=0, output_tokens_mean=0, replicas=REPLICAS) for i in range(8)]
    load = LoadPredictor(window_s=60.0).predict(samples)
    assert load.arrival_rate == 0.0 and load.prompt_tokens_mean == 777 and load.output_tokens_mean == 55


def test_the_backlog_and_worker_gauges_come_from_the_latest_sample():
    workers = (WorkerLoadSample("prefill-0", "prefill", prefill_queue_tokens=5000, kv_usage=0.5),
               WorkerLoadSample("decode-0", "decode", kv_usage=0.7, num_running_decodes=12))
    sample = MetricsSample(timestamp=10.0, interval_s=10.0, num_arrivals=5, prompt_tokens_mean=1000,
                           prompt_tokens_p90=2000, output_tokens_mean=10, replicas=REPLICAS,
                           frontend_queue_depth=3, workers=workers)
    load = LoadPredictor().predict([sample])
    assert load.backlog_tokens == 3 * 1000 + 5000
    assert load.num_running_decodes == 12 and load.decode_kv_usage == pytest.approx(0.7)   # prefill KV excluded
    doubled = load.scaled(2.0)
    assert (doubled.arrival_rate, doubled.backlog_tokens, doubled.num_running_decodes) == (1.0, 16_000, 24)
    assert doubled.prompt_tokens_mean == load.prompt_tokens_mean
