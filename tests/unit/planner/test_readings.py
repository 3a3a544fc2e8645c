"""`serve --autoscale`'s pure inputs (services/planner/readings.py): the planner's sample
from two readings of the frontend's /metrics and the workers' Stats, and which worker to drain."""

from __future__ import annotations

from dataclasses import replace

import pytest

from splitserve.proto.v1 import worker_pb2
from splitserve.services.frontend.metrics import FrontendMetrics
from splitserve.services.planner.readings import (DrainCandidate, FrontendCounters, Reading, SampleBuilder,
                                                          WorkerCounters, bucket_delta, choose_several,
                                                          choose_to_drain, histogram_quantile, replica_counts)
from splitserve.services.planner import Planner, PlannerMode, ReplicaCounts

from .conftest import make_config, make_profile

ONE = ReplicaCounts.of_aggregated(1)


def _exposition(m: FrontendMetrics) -> str:
    return m.exposition().decode()


def _arrive(m: FrontendMetrics, prompt: int, count: int = 1, *, in_flight: bool = True, max_tokens: int | None = None):
    """What the frontend records when it admits `count` requests (services/frontend/core.py);
    `max_tokens`: the cap their client set (None: they set none)."""
    m.admitted.inc(count)
    m.admitted_prompt_tokens.inc(prompt * count)
    if max_tokens is not None:
        m.admitted_capped.inc(count)
        m.admitted_max_tokens.inc(max_tokens * count)
    if in_flight:
        m.in_flight.inc(count)


def _finish(m: FrontendMetrics, prompt: int, output: int, ttft: float, itls: list[float], status: str = "ok"):
    """What the frontend records for one request admitted and ended in the same interval."""
    _arrive(m, prompt, in_flight=False)
    m.ttft.observe(ttft)
    for gap in itls:
        m.itl.observe(gap)
    if status == "ok":
        m.prompt_tokens.inc(prompt)
    m.generation_tokens.inc(output)
    m.requests.labels("completions", status).inc()


# -- histograms --------------------------------------------------------------------------------
def test_quantile_interpolates_inside_its_bucket_like_prometheus():
    buckets = ((0.1, 0.0), (0.5, 10.0), (1.0, 10.0), (float("inf"), 10.0))
    assert histogram_quantile(0.9, buckets) == pytest.approx(0.1 + 0.4 * 0.9)
    assert histogram_quantile(0.5, ((1.0, 4.0), (2.0, 8.0), (float("inf"), 8.0))) == pytest.approx(1.0)
    # In the first bucket: from 0.
    assert histogram_quantile(0.9, ((0.2, 10.0), (float("inf"), 10.0))) == pytest.approx(0.18)


def test_quantile_in_the_inf_bucket_is_the_largest_finite_bound_and_none_without_observations():
    assert histogram_quantile(0.9, ((1.0, 1.0), (2.0, 1.0), (float("inf"), 10.0))) == 2.0
    assert histogram_quantile(0.9, ((1.0, 0.0), (float("inf"), 0.0))) is None
    assert histogram_quantile(0.9, ()) is None


def test_bucket_delta_is_the_interval_and_a_reset_counts_from_zero():
    before = ((1.0, 3.0), (float("inf"), 5.0))
    assert bucket_delta(((1.0, 4.0), (float("inf"), 9.0)), before) == ((1.0, 1.0), (float("inf"), 4.0))
    assert bucket_delta(((1.0, 1.0), (float("inf"), 1.0)), before) == ((1.0, 1.0), (float("inf"), 1.0))
    assert bucket_delta(((1.0, 2.0),), ()) == ((1.0, 2.0),)


# -- the frontend's exposition -----------------------------------------------------------------
def test_parse_reads_the_frontends_own_metrics():
    m = FrontendMetrics()
    _finish(m, 100, 10, 0.2, [0.01, 0.02])
    _finish(m, 300, 30, 0.7, [0.03])
    _finish(m, 0, 4, 0.3, [], status="cancelled")
    _arrive(m, 50, 2)
    c = FrontendCounters.parse(_exposition(m))
    assert (c.ended, c.ended_ok, c.in_flight) == (3, 2, 2)
    assert (c.admitted, c.admitted_prompt_tokens) == (5, 500)
    assert (c.prompt_tokens, c.generation_tokens) == (400, 44)
    assert c.ttft_buckets[-1] == (float("inf"), 3.0)
    assert dict(c.ttft_buckets)[0.25] == 1.0 and dict(c.ttft_buckets)[1.0] == 3.0
    assert c.itl_buckets[-1] == (float("inf"), 3.0)


def test_frontends_add_up():
    a, b = FrontendMetrics(), FrontendMetrics()
    _finish(a, 100, 10, 0.2, [0.01])
    _finish(b, 50, 5, 2.0, [0.5])
    total = FrontendCounters.total([FrontendCounters.parse(_exposition(a)), FrontendCounters.parse(_exposition(b))])
    assert (total.ended, total.prompt_tokens, total.generation_tokens) == (2, 150, 15)
    assert (total.admitted, total.admitted_prompt_tokens) == (2, 150)
    # One frontend of an older version (no admission counters): the sum has none either.
    assert FrontendCounters.total([FrontendCounters(ended=1), FrontendCounters.parse(_exposition(a))]).admitted is None
    assert total.ttft_buckets[-1] == (float("inf"), 2.0)


# -- samples -----------------------------------------------------------------------------------
def _worker(name="worker-0", role="both", **kw) -> WorkerCounters:
    return WorkerCounters(name, role, **kw)


def test_the_first_reading_is_the_baseline_and_the_second_makes_a_sample_of_the_deltas():
    m = FrontendMetrics()
    _finish(m, 1000, 99, 5.0, [0.5])                   # before the baseline: not in the sample
    builder = SampleBuilder()
    w0 = _worker(num_prompt_tokens_computed=1000, num_generated_tokens=99)
    assert builder.sample(Reading(100.0, FrontendCounters.parse(_exposition(m)), (w0,)), ONE) is None
    for i in range(9):
        _finish(m, 100, 20, 0.2, [0.01, 0.01])
    _finish(m, 100, 20, 0.9, [0.2, 0.2])
    _arrive(m, 100, 3)                                 # arrived in the interval, still running
    w1 = _worker(kv_usage=0.25, num_running=3, num_waiting=2, num_prompt_tokens_computed=2300,
                 num_generated_tokens=330)
    sample = builder.sample(Reading(102.0, FrontendCounters.parse(_exposition(m)), (w1,)), ONE)
    assert sample.interval_s == 2.0 and sample.timestamp == 102.0
    assert sample.num_arrivals == 13                   # 10 ended + 3 still running: 13 admitted
    assert sample.prompt_tokens_mean == 100 and sample.prompt_tokens_p90 == 100
    assert sample.output_tokens_mean == 20
    # 9 of 10 first tokens within 0.25 s, the 10th in (0.5, 1.0]: the p90 is the 0.25 bucket's top.
    assert sample.ttft_p90_s == pytest.approx(0.25)
    assert 0.01 <= sample.itl_p90_s <= 0.25
    assert sample.frontend_queue_depth == 0 and sample.replicas == ONE
    (w,) = sample.workers
    assert (w.worker_id, w.role, w.kv_usage, w.num_running_decodes) == ("worker-0", "both", 0.25, 3)
    assert w.prefill_queue_tokens == 200               # 2 waiting x a 100-token mean prompt
    assert (w.num_prompt_tokens_computed, w.num_generated_tokens) == (1300, 231)


def test_an_interval_without_ends_keeps_the_last_means_and_has_no_latencies():
    m = FrontendMetrics()
    builder = SampleBuilder()
    builder.sample(Reading(0.0, FrontendCounters.parse(_exposition(m))), ONE)
    _finish(m, 64, 8, 0.1, [0.01])
    builder.sample(Reading(1.0, FrontendCounters.parse(_exposition(m))), ONE)
    _arrive(m, 64)
    quiet = builder.sample(Reading(2.0, FrontendCounters.parse(_exposition(m))), ONE)
    assert quiet.num_arrivals == 1
    assert (quiet.prompt_tokens_mean, quiet.output_tokens_mean) == (64, 8)
    assert quiet.ttft_p90_s is None and quiet.itl_p90_s is None


def test_a_longer_prompt_mix_shows_when_it_is_admitted_not_when_it_ends():
    m = FrontendMetrics()
    builder = SampleBuilder()
    builder.sample(Reading(0.0, FrontendCounters.parse(_exposition(m))), ONE)
    for _ in range(4):
        _finish(m, 64, 96, 0.2, [0.05])
    assert builder.sample(Reading(5.0, FrontendCounters.parse(_exposition(m))), ONE).prompt_tokens_mean == 64
    _arrive(m, 2048, 3)                                # waiting for their prefill: nothing ended
    sample = builder.sample(Reading(10.0, FrontendCounters.parse(_exposition(m))), ONE)
    assert sample.num_arrivals == 3 and sample.prompt_tokens_mean == 2048
    assert sample.ttft_p90_s is None                   # no first token yet: TTFT alone would see nothing


def test_until_a_request_ends_the_output_length_is_the_mean_cap_clients_asked_for():
    m = FrontendMetrics()
    builder = SampleBuilder()
    builder.sample(Reading(0.0, FrontendCounters.parse(_exposition(m))), ONE)
    _arrive(m, 64, 3, max_tokens=96)
    _arrive(m, 64, 1, max_tokens=200)
    _arrive(m, 64, 2)                                  # no cap: the rest of the context, no length
    first = builder.sample(Reading(5.0, FrontendCounters.parse(_exposition(m))), ONE)
    assert first.num_arrivals == 6 and first.output_tokens_mean == pytest.approx((3 * 96 + 200) / 4)
    _arrive(m, 64, 2)                                  # uncapped only: the prior stays
    assert builder.sample(Reading(10.0, FrontendCounters.parse(_exposition(m))), ONE).output_tokens_mean == 122
    m.generation_tokens.inc(40)                        # the first two end, after 20 tokens each
    m.requests.labels("completions", "ok").inc(2)
    measured = builder.sample(Reading(15.0, FrontendCounters.parse(_exposition(m))), ONE)
    assert measured.output_tokens_mean == 20
    # Measured once: a later interval without ends keeps it, whatever the new arrivals' caps.
    _arrive(m, 64, 4, max_tokens=500)
    assert builder.sample(Reading(20.0, FrontendCounters.parse(_exposition(m))), ONE).output_tokens_mean == 20


def test_frontends_sum_their_caps():
    a, b = FrontendMetrics(), FrontendMetrics()
    _arrive(a, 10, 2, max_tokens=50)
    _arrive(b, 10, 1, max_tokens=80)
    total = FrontendCounters.total([FrontendCounters.parse(_exposition(a)), FrontendCounters.parse(_exposition(b))])
    assert (total.admitted_capped, total.admitted_max_tokens) == (3, 180)


def test_restarts_count_from_zero_and_roles_shape_the_worker_sample():
    # FrontendCounters without admission counters (admitted None): a frontend of an older
    # version, whose arrivals are ends plus the change in flight and prompts count on success.
    builder = SampleBuilder(prompt_tokens_mean=50.0)
    builder.sample(Reading(0.0, FrontendCounters(ended=10, ended_ok=10, prompt_tokens=500, generation_tokens=50),
                           (_worker("prefill-0", "prefill", num_prompt_tokens_computed=900),
                            _worker("decode-0", "decode", num_generated_tokens=700))), ReplicaCounts.of_pools(1, 1))
    # The frontend restarted (counters went down); prefill-0 restarted too; decode-1 is new.
    sample = builder.sample(
        Reading(4.0, FrontendCounters(ended=2, ended_ok=2, prompt_tokens=200, generation_tokens=20),
                (_worker("prefill-0", "prefill", num_running=4, num_waiting=3, num_prompt_tokens_computed=100),
                 _worker("decode-0", "decode", num_running=5, num_waiting=1, num_generated_tokens=760),
                 _worker("decode-1", "decode", num_generated_tokens=40))),
        ReplicaCounts.of_pools(1, 2))
    assert sample.num_arrivals == 2 and sample.prompt_tokens_mean == 100 and sample.output_tokens_mean == 10
    p, d0, d1 = sample.workers
    assert (p.num_prompt_tokens_computed, p.num_running_decodes, p.prefill_queue_tokens) == (100, 0, 300)
    assert (d0.num_generated_tokens, d0.num_running_decodes, d0.prefill_queue_tokens) == (60, 5, 0)
    assert d1.num_generated_tokens == 40


def test_worker_counters_from_stats():
    stats = worker_pb2.StatsResponse(worker_id="worker-2", kv_usage=0.5, num_running=2, num_waiting=1,
                                     num_in_flight=3, num_prompt_tokens_computed=77, num_generated_tokens=88)
    w = WorkerCounters.of_stats("both", stats)
    assert (w.worker_id, w.role, w.kv_usage, w.load) == ("worker-2", "both", 0.5, 6)
    assert (w.num_prompt_tokens_computed, w.num_generated_tokens) == (77, 88)


def test_kv_reserved_for_a_remote_prefill_is_not_decode_kv_in_use():
    # 60 of 100 blocks used, 40 of them waiting for a prefill worker to fill them.
    stats = worker_pb2.StatsResponse(worker_id="decode-0", num_kv_blocks=100, num_used_kv_blocks=60, kv_usage=0.6,
                                     num_remote_prefill=4, num_remote_prefill_kv_blocks=40)
    assert WorkerCounters.of_stats("decode", stats).kv_usage == pytest.approx(0.2)


def test_replica_counts_by_mode():
    assert replica_counts(True, {"both": 3}) == ReplicaCounts.of_aggregated(3)
    assert replica_counts(False, {"prefill": 1, "decode": 2}) == ReplicaCounts.of_pools(1, 2)


# -- which worker leaves -----------------------------------------------------------------------
def test_a_starting_worker_leaves_first_newest_first():
    c = [DrainCandidate("worker-0", 0, False, load=0), DrainCandidate("worker-1", 1, True),
         DrainCandidate("worker-2", 2, True)]
    assert choose_to_drain(c).name == "worker-2"


def test_else_the_least_loaded_then_the_least_kv_then_the_newest():
    c = [DrainCandidate("worker-0", 0, False, load=1), DrainCandidate("worker-1", 1, False, load=4),
         DrainCandidate("worker-2", 2, False, load=1, kv_usage=0.3), DrainCandidate("worker-3", 3, False, load=1)]
    assert choose_to_drain(c).name == "worker-3"
    assert [x.name for x in choose_several(c, 3)] == ["worker-3", "worker-0", "worker-2"]
    assert choose_to_drain([]) is None
    assert [x.name for x in choose_several(c[:1], 5)] == ["worker-0"]


def test_a_ramp_before_any_request_ended_sizes_decode_from_the_caps():
    # As at run 18's second decision: a decode-heavy load has begun and nothing has ended yet.
    split = ReplicaCounts.of_pools(1, 1)
    planner = Planner(make_config(mode=PlannerMode.DISAGGREGATED), make_profile())
    m, builder = FrontendMetrics(), SampleBuilder()
    builder.sample(Reading(0.0, FrontendCounters.parse(_exposition(m))), split)
    _arrive(m, 64, 300, max_tokens=1024)               # 30 req/s for 10 s, none ended
    sample = builder.sample(Reading(10.0, FrontendCounters.parse(_exposition(m))), split)
    assert sample.output_tokens_mean == 1024
    decision = planner.decide([], sample)
    assert decision.replicas.num_decode > 1, decision.explain()
    # The same interval with the prior unknown (a frontend without the counters): one decode worker.
    blind = replace(sample, output_tokens_mean=0.0)
    assert planner.decide([], blind).replicas.num_decode == 1
