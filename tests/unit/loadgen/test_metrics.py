"""Metric arithmetic on synthetic timestamps with known answers."""

from __future__ import annotations

import pytest

from splitserve.loadgen import metrics
from splitserve.loadgen.metrics import SLO
from splitserve.loadgen.recorder import CANCELLED, RequestRecord


def record(start: float, chunks: list[float], end: float, out: int | None, ok: bool = True, **kw) -> RequestRecord:
    r = RequestRecord(request_index=kw.pop("index", 0), conversation_id="c", turn=0, max_tokens=out or 1,
                      num_prompt_tokens=10, start_s=start, end_s=end, ok=ok, chunk_times_s=chunks,
                      output_tokens=out, prompt_tokens=10, **kw)
    metrics.finish_record(r)
    return r


def test_ttft_itl_and_gaps_of_one_request():
    r = record(start=1.0, chunks=[0.2, 0.3, 0.45, 0.5], end=1.5, out=4)
    assert r.ttft_s == pytest.approx(0.2)
    assert r.e2e_s == pytest.approx(0.5)
    assert r.itl_s == pytest.approx((0.5 - 0.2) / 3)
    assert metrics.chunk_gaps(r.chunk_times_s) == pytest.approx([0.1, 0.15, 0.05])


def test_chunks_carrying_several_tokens_still_give_per_token_itl():
    # 2 chunks, 9 tokens: ITL is (e2e - ttft) / 8, not the single chunk gap
    r = record(start=0.0, chunks=[0.1, 0.9], end=0.9, out=9)
    assert r.itl_s == pytest.approx(0.1)
    assert metrics.chunk_gaps(r.chunk_times_s) == pytest.approx([0.8])


def test_one_token_output_has_ttft_but_no_itl():
    r = record(start=0.0, chunks=[0.25], end=0.3, out=1)
    assert r.ttft_s == pytest.approx(0.25)
    assert r.itl_s is None
    assert metrics.chunk_gaps(r.chunk_times_s) == []


def test_no_content_at_all_has_no_ttft():
    r = record(start=0.0, chunks=[], end=0.3, out=0)
    assert r.ttft_s is None and r.itl_s is None


def test_percentiles_interpolate_linearly():
    xs = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert metrics.percentile(xs, 50) == 3.0
    assert metrics.percentile(xs, 90) == pytest.approx(4.6)
    assert metrics.percentile(xs, 99) == pytest.approx(4.96)
    assert metrics.percentile([7.0], 99) == 7.0
    assert metrics.percentile([], 50) is None
    d = metrics.distribution([3.0, None, 1.0, 2.0])
    assert d == {"count": 3, "mean": 2.0, "p50": 2.0, "p90": pytest.approx(2.8), "p99": pytest.approx(2.98),
                 "min": 1.0, "max": 3.0}
    assert metrics.distribution([])["p50"] is None


def test_summary_rates_goodput_and_errors():
    recs = [
        record(0.0, [0.1, 0.2, 0.3], 0.3, 3, index=0),        # ttft 0.1, itl 0.1   -> meets
        record(0.5, [0.6, 0.7], 1.2, 2, index=1),              # ttft 0.6, itl 0.1   -> misses ttft
        record(1.0, [0.1], 0.2, 1, index=2),                    # 1 token: no itl    -> meets
        record(1.5, [], 2.0, None, ok=False, error_kind="http_503", index=3),
        record(1.6, [0.05], 1.7, None, ok=False, error_kind="disconnected", index=4),
        record(1.8, [], 2.0, None, ok=False, error_kind=CANCELLED, index=5),
    ]
    s = metrics.summarize(recs, SLO(ttft_s=0.5, itl_s=0.15))
    assert (s["num_requests"], s["num_ok"], s["num_errors"], s["num_cancelled"]) == (6, 3, 2, 1)
    assert s["errors_by_kind"] == {"disconnected": 1, "http_503": 1}
    assert s["duration_s"] == pytest.approx(2.0)
    assert s["requests_per_s"] == pytest.approx(1.5)
    assert s["output_tokens_per_s"] == pytest.approx(3.0)
    assert s["goodput_requests_per_s"] == pytest.approx(1.0)
    assert s["slo_attainment"] == pytest.approx(2 / 5)       # cancelled requests are not judged
    assert s["ttft_s"]["count"] == 3 and s["ttft_s"]["max"] == pytest.approx(0.6)
    assert s["itl_s"]["count"] == 2 and s["itl_s"]["mean"] == pytest.approx(0.1)
    assert s["chunk_gap_s"]["count"] == 3


def test_without_slo_goodput_counts_successes():
    recs = [record(0.0, [0.1], 1.0, 1), record(0.0, [], 1.0, None, ok=False, error_kind="http_400", index=1)]
    s = metrics.summarize(recs)
    assert s["goodput_requests_per_s"] == pytest.approx(1.0)
    assert s["slo_attainment"] == pytest.approx(0.5)


def test_empty_run_summarizes_to_nothing():
    s = metrics.summarize([])
    assert s["num_requests"] == 0 and s["requests_per_s"] is None and s["slo_attainment"] is None


def test_throughput_timeline_spreads_tokens_over_chunks():
    recs = [record(0.0, [0.5, 1.5], 1.6, 4), record(1.0, [0.2], 1.3, 2, index=1)]
    times, rates = metrics.throughput_timeline(recs, bin_s=1.0)
    assert times == [0.5, 1.5]
    assert rates == pytest.approx([2.0, 4.0])      # 4 tokens over 2 chunks; then 2 + 2
