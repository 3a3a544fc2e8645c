"""Latency and throughput arithmetic: pure functions of the records' timestamps.

Definitions (per request, times in seconds):

- TTFT: request start → first chunk with non-empty content (role-only chunks,
  empty deltas and the usage chunk do not count).
- ITL (inter-token latency): (e2e − TTFT) / (output tokens − 1); undefined for
  one-token outputs. Output tokens come from the server's usage, else the
  tokenizer, never from splitting text.
- Inter-chunk gaps: time between consecutive non-empty chunks (a chunk may
  carry several tokens, so gaps show stalls the ITL average hides).
- E2E: request start → end of the response.

Aggregates over a run: distributions (mean, p50, p90, p99, min, max; linear
interpolation between order statistics), requests/s and output tokens/s over the
run's span (first start → last end), goodput (requests/s meeting every SLO),
SLO attainment (fraction of finished requests meeting them), errors by kind, and
the client's start lag behind an open-loop schedule (start − scheduled; large
values mean the client, not the server, limited the offered load).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from splitserve.loadgen.recorder import CANCELLED, RequestRecord

DIST_FIELDS = ("mean", "p50", "p90", "p99", "min", "max")


@dataclass(slots=True, frozen=True)
class SLO:
    """Per-request targets in seconds; None means no target."""

    ttft_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None

    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_s, self.itl_s, self.e2e_s))

    def describe(self) -> dict:
        return {"ttft_s": self.ttft_s, "itl_s": self.itl_s, "e2e_s": self.e2e_s}


# -- per request -----------------------------------------------------------------------
def ttft(chunk_times_s: list[float]) -> float | None:
    return chunk_times_s[0] if chunk_times_s else None


def itl(e2e_s: float | None, ttft_s: float | None, num_output_tokens: int | None) -> float | None:
    if e2e_s is None or ttft_s is None or not num_output_tokens or num_output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (num_output_tokens - 1)


def chunk_gaps(chunk_times_s: list[float]) -> list[float]:
    return [b - a for a, b in zip(chunk_times_s, chunk_times_s[1:])]


def finish_record(record: RequestRecord) -> None:
    """Fill the record's derived latencies from its timestamps and token count."""
    record.e2e_s = None if record.end_s is None else record.end_s - record.start_s
    record.ttft_s = ttft(record.chunk_times_s)
    record.itl_s = itl(record.e2e_s, record.ttft_s, record.output_tokens)


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    if not record.ok:
        return False
    for target, value in ((slo.ttft_s, record.ttft_s), (slo.itl_s, record.itl_s), (slo.e2e_s, record.e2e_s)):
        if target is not None and value is not None and value > target:
            return False
    return not (slo.ttft_s is not None and record.ttft_s is None)


# -- aggregates ------------------------------------------------------------------------
def percentile(sorted_values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) of already-sorted values, linear interpolation."""
    if not sorted_values:
        return None
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict:
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return {"count": 0, **{k: None for k in DIST_FIELDS}}
    return {"count": len(xs), "mean": sum(xs) / len(xs), "p50": percentile(xs, 50), "p90": percentile(xs, 90),
            "p99": percentile(xs, 99), "min": xs[0], "max": xs[-1]}


def span(records: list[RequestRecord]) -> float:
    """Seconds from the first request's start to the last one's end (0 when nothing ended)."""
    ends = [r.end_s for r in records if r.end_s is not None]
    if not ends:
        return 0.0
    return max(ends) - min(r.start_s for r in records)


def summarize(records: list[RequestRecord], slo: SLO = SLO()) -> dict:
    """The run's aggregates (the `summary` object of the JSON file)."""
    ok = [r for r in records if r.ok]
    cancelled = sum(1 for r in records if r.error_kind == CANCELLED)
    finished = len(records) - cancelled
    errors = Counter(r.error_kind for r in records if not r.ok and r.error_kind != CANCELLED)
    duration = span(records)
    num_good = sum(1 for r in records if meets_slo(r, slo))
    total_out = sum(r.output_tokens or 0 for r in ok)
    total_in = sum(r.prompt_tokens or r.num_prompt_tokens or 0 for r in ok)
    total_cached = sum(r.cached_tokens or 0 for r in ok)
    per_s = (lambda n: n / duration if duration > 0 else None)
    return {
        "num_requests": len(records), "num_ok": len(ok), "num_errors": sum(errors.values()),
        "num_cancelled": cancelled, "errors_by_kind": dict(sorted(errors.items())),
        "duration_s": duration,
        "requests_per_s": per_s(len(ok)),
        "output_tokens_per_s": per_s(total_out),
        "prompt_tokens_per_s": per_s(total_in),
        "total_output_tokens": total_out, "total_prompt_tokens": total_in, "total_cached_tokens": total_cached,
        "goodput_requests_per_s": per_s(num_good),
        "slo_attainment": num_good / finished if finished else None,
        "slo": slo.describe(),
        "ttft_s": distribution([r.ttft_s for r in ok]),
        "itl_s": distribution([r.itl_s for r in ok]),
        "e2e_s": distribution([r.e2e_s for r in ok]),
        "chunk_gap_s": distribution([g for r in ok for g in chunk_gaps(r.chunk_times_s)]),
        "start_lag_s": distribution([r.start_s - r.scheduled_s for r in records if r.scheduled_s is not None]),
        "output_tokens_per_request": distribution([r.output_tokens for r in ok]),
        "request_output_tokens_per_s": distribution(
            [r.output_tokens / r.e2e_s for r in ok if r.output_tokens and r.e2e_s]),
    }


def throughput_timeline(records: list[RequestRecord], bin_s: float = 1.0) -> tuple[list[float], list[float]]:
    """Output tokens/s in bins of `bin_s` over the run. A request's tokens are spread
    evenly over its non-empty chunks (a chunk may carry several tokens)."""
    ok = [r for r in records if r.ok and r.chunk_times_s and r.output_tokens]
    if not ok:
        return [], []
    t0 = min(r.start_s for r in records)
    end = max(r.start_s + r.chunk_times_s[-1] for r in ok) - t0
    bins = [0.0] * (int(end // bin_s) + 1)
    for r in ok:
        weight = r.output_tokens / len(r.chunk_times_s)
        for t in r.chunk_times_s:
            bins[int((r.start_s - t0 + t) // bin_s)] += weight
    return [(i + 0.5) * bin_s for i in range(len(bins))], [n / bin_s for n in bins]
