"""CapacityProfile: interpolation, construction from a profile run, online refinement."""

from __future__ import annotations

import pytest

from splitserve.services.planner import (CapacityKind, CapacityObservation, CapacityProfile, DecodeMeasurement,
                                         MetricsSample, PrefillMeasurement, ReplicaCounts, ThroughputCurve,
                                         WorkerLoadSample, observations_from_sample)


def test_a_curve_interpolates_between_points_and_holds_its_ends():
    curve = ThroughputCurve(((100, 1000.0), (300, 3000.0)))
    assert curve.at(200) == pytest.approx(2000.0)
    assert curve.at(10) == 1000.0 and curve.at(10_000) == 3000.0


def test_a_curve_refuses_unsorted_or_empty_points():
    with pytest.raises(ValueError):
        ThroughputCurve(((300, 1.0), (100, 1.0)))
    with pytest.raises(ValueError):
        ThroughputCurve(())
    with pytest.raises(ValueError):
        ThroughputCurve(((1, 0.0),))


def test_a_profile_run_becomes_curves_with_repeats_averaged():
    profile = CapacityProfile.from_measurements(
        prefill=[PrefillMeasurement(512, 0.1), PrefillMeasurement(512, 0.2), PrefillMeasurement(2048, 0.25)],
        decode=[DecodeMeasurement(1, 0.02), DecodeMeasurement(32, 0.04)], startup_s=45.0, kv_capacity_tokens=100_000)
    assert profile.prefill.points == ((512.0, pytest.approx((5120 + 2560) / 2)), (2048.0, pytest.approx(8192.0)))
    assert profile.decode.at(1) == pytest.approx(50.0) and profile.decode.at(32) == pytest.approx(800.0)
    assert profile.token_seconds(32) == pytest.approx(0.04)      # the ITL at that batch is its step time
    assert profile.prefill_seconds(2048) == pytest.approx(0.25)
    assert profile.startup_s == 45.0 and profile.kv_capacity_tokens == 100_000
    with pytest.raises(ValueError):
        CapacityProfile.from_measurements([], [DecodeMeasurement(1, 0.02)], startup_s=1.0)


def test_refine_moves_the_nearest_point_by_alpha_of_the_error():
    profile = CapacityProfile(ThroughputCurve(((1000, 10_000.0),)), ThroughputCurve(((8, 400.0),)), startup_s=60.0)
    refined = profile.refine([CapacityObservation(CapacityKind.PREFILL, 1100, 6000.0)], alpha=0.25)
    assert refined.prefill.points == ((1000, pytest.approx(9000.0)),)    # within 25 %: that point moves
    assert profile.prefill.points == ((1000, 10_000.0),)                  # the old profile is unchanged
    far = refined.refine([CapacityObservation(CapacityKind.DECODE, 64, 2000.0)], startup_s=100.0, alpha=0.5)
    assert far.decode.points == ((8, 400.0), (64, pytest.approx(1200.0)))   # new point: halfway from 400
    assert far.startup_s == pytest.approx(80.0)


def test_repeated_observations_converge_on_the_measured_capacity():
    profile = CapacityProfile(ThroughputCurve(((2048, 10_000.0),)), ThroughputCurve(((16, 500.0),)), startup_s=60.0)
    for _ in range(40):
        profile = profile.refine([CapacityObservation(CapacityKind.PREFILL, 2048, 6000.0)])
    assert profile.prefill.at(2048) == pytest.approx(6000.0, rel=0.01)


def test_observations_come_only_from_intervals_that_measure_capacity():
    workers = (
        WorkerLoadSample("decode-0", "decode", num_running_decodes=16, num_generated_tokens=4000),
        WorkerLoadSample("decode-1", "decode", num_running_decodes=4, num_generated_tokens=500,
                         num_prompt_tokens_computed=300),                      # also prefilled: not pure decode
        WorkerLoadSample("decode-2", "decode"),                                 # idle
        WorkerLoadSample("prefill-0", "prefill", prefill_queue_tokens=4096, num_prompt_tokens_computed=80_000),
        WorkerLoadSample("prefill-1", "prefill", num_prompt_tokens_computed=10_000),   # ran dry: not saturated
    )
    sample = MetricsSample(timestamp=10.0, interval_s=10.0, num_arrivals=40, prompt_tokens_mean=2000,
                           prompt_tokens_p90=3000, output_tokens_mean=100, replicas=ReplicaCounts.of_pools(2, 3),
                           workers=workers)
    assert observations_from_sample(sample) == [CapacityObservation(CapacityKind.DECODE, 16, 400.0),
                                                CapacityObservation(CapacityKind.PREFILL, 2000, 8000.0)]


def test_samples_validate_their_fields():
    with pytest.raises(ValueError):
        ReplicaCounts(num_prefill=1, num_aggregated=2)
    with pytest.raises(ValueError):
        WorkerLoadSample("w", "router")
    with pytest.raises(ValueError):
        MetricsSample(timestamp=1.0, interval_s=0.0, num_arrivals=1, prompt_tokens_mean=1, prompt_tokens_p90=1,
                      output_tokens_mean=1, replicas=ReplicaCounts.of_pools(1, 1))


def test_a_prefill_worker_busy_throughout_counts_the_intervals_it_finished_nothing_in():
    """A step of a batch of long prompts outlasts an interval: its tokens land in every other
    interval. Counting only the lumps would read 2x; with the empty busy intervals it reads true."""
    def sample_at(t: float, computed: int) -> MetricsSample:
        worker = WorkerLoadSample("prefill-0", "prefill", prefill_queue_tokens=2048, num_prompt_tokens_computed=computed)
        return MetricsSample(timestamp=t, interval_s=5.0, num_arrivals=2, prompt_tokens_mean=512, prompt_tokens_p90=512,
                             output_tokens_mean=8, replicas=ReplicaCounts.of_pools(1, 1), workers=(worker,))

    series = [sample_at(5.0 * (i + 1), 2048 if i % 2 else 0) for i in range(80)]     # 2048 tokens / 10 s
    assert observations_from_sample(series[0]) == []                   # nothing finished, busy since when?
    assert observations_from_sample(series[2], series[1]) == [CapacityObservation(CapacityKind.PREFILL, 512, 0.0)]
    lumps_only = busy = CapacityProfile(ThroughputCurve(((512, 300.0),)), ThroughputCurve(((8, 50.0),)), startup_s=10.0)
    for previous, sample in zip(series, series[1:]):
        busy = busy.refine(observations_from_sample(sample, previous), alpha=0.05)
        lumps_only = lumps_only.refine(observations_from_sample(sample), alpha=0.05)
    assert busy.prefill.at(512) == pytest.approx(204.8, rel=0.1)
    assert lumps_only.prefill.at(512) == pytest.approx(409.6, rel=0.1)
