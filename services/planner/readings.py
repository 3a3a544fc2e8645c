"""The planner's inputs from live metrics, as pure functions (used by `serve --autoscale` and the
operator's autoscaler): one `MetricsSample` per interval from two readings of the frontends'
/metrics and the workers' Stats, and which worker to drain.

Readings (`Reading`): every frontend's Prometheus exposition summed (`FrontendCounters`)
and each worker's Stats (`WorkerCounters`), taken at one time. `SampleBuilder.sample(reading,
replicas)` turns the difference between this reading and the previous one into a sample:

- arrivals = delta(splitserve_admitted_requests_total), and prompt_tokens_mean =
  delta(splitserve_admitted_prompt_tokens_total) / arrivals: the frontend counts both when it
  admits a request, so a longer prompt mix shows in the interval it arrives, while those
  prompts still wait (not a TTFT later, when they end).
  Frontends without those counters (an older version): arrivals = delta(requests ended) +
  delta(splitserve_requests_in_flight), clamped at 0, and prompt_tokens_mean =
  delta(splitserve_prompt_tokens_total) / delta(requests ended "ok").
- output_tokens_mean = delta(splitserve_generation_tokens_total) / delta(requests ended).
  An interval in which nothing arrived (nothing ended) keeps the last prompt (output) mean.
  Until the first request ends, the output length is the prior of the requests admitted:
  delta(splitserve_admitted_max_tokens_total) / delta(splitserve_admitted_capped_requests_total),
  the mean cap of those whose client set max_tokens (a request without one is left out: the
  rest of the context says nothing of its length). Without it the first decisions of a ramp
  read the output as 0 tokens long and planned one decode worker for any load (bench run 18).
  A cap is an upper bound, so the prior errs towards more decode capacity, for as long as no
  request has ended.
- prompt_tokens_p90 = prompt_tokens_mean: the frontend has no histogram of prompt lengths
  (the predictor takes the largest p90 of its window, so a long-prompt phase still shows).
- ttft_p90_s, itl_p90_s: the 0.9 quantile of the interval's histogram (bucket counts of this
  reading minus the previous one), interpolated linearly inside its bucket as Prometheus'
  histogram_quantile does; None when the interval observed nothing.
- frontend_queue_depth = 0: the frontend holds no queue (it routes each request at once;
  requests wait in the workers' queues, read below).
- per worker (`WorkerLoadSample`): kv_usage and running decodes (0 for a prefill worker, whose
  running sequences are prefills) from its Stats; prefill_queue_tokens = its waiting
  requests times the prompt mean (Stats counts requests, not their tokens); prompt tokens
  computed and tokens generated as deltas of its counters (a worker seen for the first time,
  or whose counters went down, a restart, counts from 0).

A counter that went down (a restarted frontend) counts from 0 as well, as Prometheus'
rate() does. That is right for one frontend; when several are summed, the caller drops the
baseline instead (`previous = None`: the next reading is a new baseline), as
services/launch/local_metrics.py does when one frontend's count of ended requests went down.

`choose_to_drain(candidates)`: the worker a pool gives up when the planner shrinks it: one
still starting (nothing runs there yet; the newest first), else the serving one with the
least work (requests running, waiting and in flight, then KV in use), the newest on a tie,
so that the longest-running workers, whose prefix caches are warm, stay.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from splitserve.services.planner import MetricsSample, ReplicaCounts, WorkerLoadSample

TTFT_HISTOGRAM = "splitserve_time_to_first_token_seconds"
ITL_HISTOGRAM = "splitserve_inter_token_latency_seconds"


@dataclass(frozen=True, slots=True)
class FrontendCounters:
    """The frontends' counters, gauges and latency histograms (summed over frontends)."""

    ended: float = 0.0                 # requests that ended, any status
    ended_ok: float = 0.0
    in_flight: float = 0.0
    admitted: float | None = None      # None: a frontend without the admission counters
    admitted_prompt_tokens: float = 0.0
    admitted_capped: float = 0.0       # admitted requests whose client set max_tokens
    admitted_max_tokens: float = 0.0   # their max_tokens, summed
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    ttft_buckets: tuple[tuple[float, float], ...] = ()    # (upper bound, cumulative count), +Inf last
    itl_buckets: tuple[tuple[float, float], ...] = ()

    @classmethod
    def parse(cls, text: str) -> FrontendCounters:
        """One frontend's /metrics (Prometheus text exposition)."""
        from prometheus_client.parser import text_string_to_metric_families

        values: dict[str, float] = {}
        ended = ended_ok = 0.0
        buckets: dict[str, dict[float, float]] = {TTFT_HISTOGRAM: {}, ITL_HISTOGRAM: {}}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "splitserve_requests_total":
                    ended += s.value
                    ended_ok += s.value if s.labels.get("status") == "ok" else 0.0
                elif s.name.endswith("_bucket") and s.name[:-len("_bucket")] in buckets:
                    buckets[s.name[:-len("_bucket")]][float(s.labels["le"])] = s.value
                else:
                    values[s.name] = s.value
        return cls(ended=ended, ended_ok=ended_ok, in_flight=values.get("splitserve_requests_in_flight", 0.0),
                   admitted=values.get("splitserve_admitted_requests_total"),
                   admitted_prompt_tokens=values.get("splitserve_admitted_prompt_tokens_total", 0.0),
                   admitted_capped=values.get("splitserve_admitted_capped_requests_total", 0.0),
                   admitted_max_tokens=values.get("splitserve_admitted_max_tokens_total", 0.0),
                   prompt_tokens=values.get("splitserve_prompt_tokens_total", 0.0),
                   generation_tokens=values.get("splitserve_generation_tokens_total", 0.0),
                   ttft_buckets=tuple(sorted(buckets[TTFT_HISTOGRAM].items())),
                   itl_buckets=tuple(sorted(buckets[ITL_HISTOGRAM].items())))

    def __add__(self, other: FrontendCounters) -> FrontendCounters:
        admitted = None if self.admitted is None or other.admitted is None else self.admitted + other.admitted
        return FrontendCounters(self.ended + other.ended, self.ended_ok + other.ended_ok,
                                self.in_flight + other.in_flight, admitted,
                                self.admitted_prompt_tokens + other.admitted_prompt_tokens,
                                self.admitted_capped + other.admitted_capped,
                                self.admitted_max_tokens + other.admitted_max_tokens,
                                self.prompt_tokens + other.prompt_tokens,
                                self.generation_tokens + other.generation_tokens,
                                _add_buckets(self.ttft_buckets, other.ttft_buckets),
                                _add_buckets(self.itl_buckets, other.itl_buckets))

    @classmethod
    def total(cls, readings: Iterable[FrontendCounters]) -> FrontendCounters:
        readings = list(readings)
        if not readings:
            return cls()
        out = readings[0]
        for r in readings[1:]:
            out = out + r
        return out


@dataclass(frozen=True, slots=True)
class WorkerCounters:
    """One worker's Stats, the fields the planner reads."""

    worker_id: str
    role: str                          # prefill | decode | both
    kv_usage: float = 0.0              # blocks reserved for a remote prefill left out (of_stats)
    num_running: int = 0
    num_waiting: int = 0
    num_in_flight: int = 0
    num_prompt_tokens_computed: int = 0     # since the worker started
    num_generated_tokens: int = 0

    @classmethod
    def of_stats(cls, role: str, stats) -> WorkerCounters:
        """From a worker_pb2.StatsResponse (`role` as serve started it). KV reserved for prompts
        still waiting on a prefill worker is prefill backlog: counted as decode KV in use, it
        made the planner grow the decode pool while the prefill pool was short."""
        kv_usage = stats.kv_usage
        if stats.num_kv_blocks:
            kv_usage = max(0, stats.num_used_kv_blocks - stats.num_remote_prefill_kv_blocks) / stats.num_kv_blocks
        return cls(stats.worker_id, role, kv_usage, stats.num_running, stats.num_waiting,
                   stats.num_in_flight, stats.num_prompt_tokens_computed, stats.num_generated_tokens)

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting + self.num_in_flight


@dataclass(frozen=True, slots=True)
class Reading:
    timestamp: float                              # monotonic seconds
    frontend: FrontendCounters
    workers: tuple[WorkerCounters, ...] = ()      # the serving workers that answered Stats


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative (upper bound, count) buckets, +Inf last, as Prometheus'
    histogram_quantile: linear inside the bucket it falls in (from 0 for the first bucket); the
    largest finite bound when it falls in +Inf. None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def bucket_delta(now: Sequence[tuple[float, float]], before: Sequence[tuple[float, float]]
                 ) -> tuple[tuple[float, float], ...]:
    """The interval's cumulative buckets; the whole of `now` when it went down (a restart)."""
    previous = dict(before)
    if any(count < previous.get(bound, 0.0) for bound, count in now):
        return tuple(now)
    return tuple((bound, count - previous.get(bound, 0.0)) for bound, count in now)


def _add_buckets(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    if not a:
        return tuple(b)
    if not b:
        return tuple(a)
    merged: dict[float, float] = dict(a)
    for bound, count in b:
        merged[bound] = merged.get(bound, 0.0) + count
    return tuple(sorted(merged.items()))


def _delta(now: float, before: float) -> float:
    return now if now < before else now - before


@dataclass(slots=True)
class SampleBuilder:
    """Samples from consecutive readings (module header); the first reading only sets the baseline."""

    previous: Reading | None = None
    prompt_tokens_mean: float = 0.0        # the last means seen (kept through intervals without ends)
    output_tokens_mean: float = 0.0
    outputs_seen: bool = False             # a request has ended: the output mean is measured, not the prior
    _last_workers: dict[str, WorkerCounters] = field(default_factory=dict)

    def sample(self, reading: Reading, replicas: ReplicaCounts) -> MetricsSample | None:
        """The interval since the previous reading; None for the first reading."""
        previous, self.previous = self.previous, reading
        seen = {w.worker_id: w for w in previous.workers} if previous is not None else {}
        self._last_workers = {**self._last_workers, **seen}
        if previous is None:
            return None
        interval = reading.timestamp - previous.timestamp
        if interval <= 0:
            raise ValueError("readings must come in increasing time order")
        now, before = reading.frontend, previous.frontend
        ended = _delta(now.ended, before.ended)
        ended_ok = _delta(now.ended_ok, before.ended_ok)
        if now.admitted is not None and before.admitted is not None:
            arrivals = round(_delta(now.admitted, before.admitted))
            if arrivals > 0:
                self.prompt_tokens_mean = _delta(now.admitted_prompt_tokens, before.admitted_prompt_tokens) / arrivals
        else:
            arrivals = max(0, round(ended + now.in_flight - before.in_flight))
            if ended_ok > 0:
                self.prompt_tokens_mean = _delta(now.prompt_tokens, before.prompt_tokens) / ended_ok
        if ended > 0:
            self.output_tokens_mean = _delta(now.generation_tokens, before.generation_tokens) / ended
            self.outputs_seen = True
        elif not self.outputs_seen and (capped := _delta(now.admitted_capped, before.admitted_capped)) > 0:
            self.output_tokens_mean = _delta(now.admitted_max_tokens, before.admitted_max_tokens) / capped
        workers = tuple(self._worker_sample(w, self._last_workers.get(w.worker_id)) for w in reading.workers)
        return MetricsSample(
            timestamp=reading.timestamp, interval_s=interval, num_arrivals=arrivals,
            prompt_tokens_mean=self.prompt_tokens_mean, prompt_tokens_p90=self.prompt_tokens_mean,
            output_tokens_mean=self.output_tokens_mean, replicas=replicas,
            ttft_p90_s=histogram_quantile(0.9, bucket_delta(now.ttft_buckets, before.ttft_buckets)),
            itl_p90_s=histogram_quantile(0.9, bucket_delta(now.itl_buckets, before.itl_buckets)),
            frontend_queue_depth=0, workers=workers)

    def _worker_sample(self, w: WorkerCounters, before: WorkerCounters | None) -> WorkerLoadSample:
        prompt_before = before.num_prompt_tokens_computed if before is not None else 0
        generated_before = before.num_generated_tokens if before is not None else 0
        return WorkerLoadSample(
            worker_id=w.worker_id, role=w.role,
            prefill_queue_tokens=round(w.num_waiting * self.prompt_tokens_mean) if w.role != "decode" else 0,
            kv_usage=min(1.0, max(0.0, w.kv_usage)),
            num_running_decodes=0 if w.role == "prefill" else w.num_running,
            num_prompt_tokens_computed=int(_delta(w.num_prompt_tokens_computed, prompt_before)),
            num_generated_tokens=int(_delta(w.num_generated_tokens, generated_before)))


@dataclass(frozen=True, slots=True)
class DrainCandidate:
    name: str
    index: int                         # the order workers were started in (worker-3: 3)
    starting: bool                     # not SERVING yet
    load: int = 0                      # running + waiting + in flight (Stats)
    kv_usage: float = 0.0


def choose_to_drain(candidates: Sequence[DrainCandidate]) -> DrainCandidate | None:
    """The worker to stop first when its pool shrinks (module header); None when there is none."""
    if not candidates:
        return None
    starting = [c for c in candidates if c.starting]
    if starting:
        return max(starting, key=lambda c: c.index)
    return min(candidates, key=lambda c: (c.load, c.kv_usage, -c.index))


def choose_several(candidates: Sequence[DrainCandidate], count: int) -> list[DrainCandidate]:
    """`count` workers to stop, chosen one after another by `choose_to_drain`."""
    left, out = list(candidates), []
    while left and len(out) < count:
        pick = choose_to_drain(left)
        out.append(pick)
        left.remove(pick)
    return out


def replica_counts(aggregated: bool, roles: Mapping[str, int]) -> ReplicaCounts:
    """ReplicaCounts from a count of workers by role (both | prefill | decode)."""
    if aggregated:
        return ReplicaCounts.of_aggregated(roles.get("both", 0))
    return ReplicaCounts.of_pools(roles.get("prefill", 0), roles.get("decode", 0))
