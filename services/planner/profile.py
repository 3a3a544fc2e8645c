"""One worker's capacity: how fast it prefills and decodes, and how long it takes to start.

A `CapacityProfile` holds two curves, each a few measured (x, tokens/s) points,
interpolated linearly between points and held flat beyond the end points:

- `prefill`: x = prompt length → prompt tokens/s of one worker busy with prompts that long;
- `decode`: x = batch size (running sequences) → tokens/s one worker generates for the batch.

From them: one prompt's prefill time P / prefill(P), and the per-token time at batch b,
b / decode(b), which is the inter-token latency (ITL) a sequence sees in that batch.
Beyond the largest measured batch decode(b) stays flat, so the ITL grows linearly there.

Made by a short profile run (`from_measurements`: timed prompts of a few lengths, timed
decode steps at a few batch sizes; repeated x are averaged) and refined online
(`refine`) by an exponential moving average with weight `alpha` (default 0.2): an
observation at x moves the nearest point within `SNAP_FRACTION` (25 %) of x to
(1 - alpha) * old + alpha * observed; without such a point, one is added at x with
(1 - alpha) * curve(x) + alpha * observed. One noisy interval moves the curve by alpha
of its error, never to the raw value. The start-up time is refined the same way.

`observations_from_sample` reads one interval's worker counters, keeping only those
that measure capacity: a decode-only worker that decoded without prefilling (its
generated tokens/s at its batch), and a prefill-only worker still holding queued
prompt tokens at the end of the interval (its prompt tokens/s at the interval's mean
prompt length). The worker counts a prompt's tokens when a step finishes a chunk, and a
step of a batch of long prompts can outlast an interval: were only intervals that saw a
chunk finish counted, the lumps would read as a worker several times faster than it is.
So a worker that held queued tokens at both ends of an interval (`previous`) was busy
throughout, and an interval in which it finished nothing is an observation of 0 tokens/s:
the moving average of the lumps and the gaps is its throughput.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import Enum

from splitserve.services.planner.samples import MetricsSample

SNAP_FRACTION = 0.25
DEFAULT_REFINE_ALPHA = 0.2


@dataclass(frozen=True, slots=True)
class ThroughputCurve:
    """(x, tokens/s) points, x strictly increasing, tokens/s > 0."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a throughput curve needs at least one point")
        xs = [x for x, _ in self.points]
        if any(b <= a for a, b in zip(xs, xs[1:])) or xs[0] < 0:
            raise ValueError(f"curve points must have x >= 0, strictly increasing: {self.points}")
        if any(tps <= 0 for _, tps in self.points):
            raise ValueError(f"curve throughputs must be > 0: {self.points}")

    @classmethod
    def from_points(cls, points: Iterable[tuple[float, float]]) -> ThroughputCurve:
        """Any order; points at the same x are averaged."""
        by_x: dict[float, list[float]] = {}
        for x, tps in points:
            by_x.setdefault(float(x), []).append(float(tps))
        return cls(tuple((x, sum(v) / len(v)) for x, v in sorted(by_x.items())))

    def at(self, x: float) -> float:
        pts = self.points
        if x <= pts[0][0]:
            return pts[0][1]
        if x >= pts[-1][0]:
            return pts[-1][1]
        i = bisect.bisect_right([p[0] for p in pts], x)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def refined(self, x: float, tokens_per_s: float, alpha: float) -> ThroughputCurve:
        """This curve moved toward one observation (the module header's rule); one of negative
        throughput, or at a negative x, is ignored (0 counts: a busy interval that finished nothing)."""
        if tokens_per_s < 0 or x < 0:
            return self
        pts = list(self.points)
        nearest = min(range(len(pts)), key=lambda i: abs(pts[i][0] - x))
        px, py = pts[nearest]
        if abs(px - x) <= SNAP_FRACTION * max(px, x):
            pts[nearest] = (px, (1 - alpha) * py + alpha * tokens_per_s)
        else:
            pts.append((x, (1 - alpha) * self.at(x) + alpha * tokens_per_s))
        return ThroughputCurve(tuple(sorted(pts)))


@dataclass(frozen=True, slots=True)
class PrefillMeasurement:
    prompt_tokens: int
    seconds: float            # wall time to prefill this prompt alone


@dataclass(frozen=True, slots=True)
class DecodeMeasurement:
    batch_size: int
    step_seconds: float       # one decode step of the whole batch (one token per sequence)


class CapacityKind(Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class CapacityObservation:
    kind: CapacityKind
    x: float                  # prompt tokens (PREFILL) or batch size (DECODE)
    tokens_per_s: float


@dataclass(frozen=True, slots=True)
class CapacityProfile:
    prefill: ThroughputCurve
    decode: ThroughputCurve
    startup_s: float                        # from "start a worker" to serving
    kv_capacity_tokens: int | None = None   # tokens of KV one worker holds; None: unknown

    def __post_init__(self) -> None:
        if self.startup_s < 0:
            raise ValueError(f"startup_s must be >= 0, got {self.startup_s}")

    @classmethod
    def from_measurements(cls, prefill: Iterable[PrefillMeasurement], decode: Iterable[DecodeMeasurement],
                          startup_s: float, kv_capacity_tokens: int | None = None) -> CapacityProfile:
        prefill_points = [(m.prompt_tokens, m.prompt_tokens / m.seconds) for m in prefill if m.seconds > 0]
        decode_points = [(m.batch_size, m.batch_size / m.step_seconds) for m in decode if m.step_seconds > 0]
        if not prefill_points or not decode_points:
            raise ValueError("a profile needs at least one timed prefill and one timed decode step")
        return cls(ThroughputCurve.from_points(prefill_points), ThroughputCurve.from_points(decode_points),
                   startup_s, kv_capacity_tokens)

    def prefill_seconds(self, prompt_tokens: float) -> float:
        """One prompt's prefill time on an otherwise idle worker."""
        return prompt_tokens / self.prefill.at(prompt_tokens)

    def token_seconds(self, batch_size: float) -> float:
        """The per-token time (ITL) of a sequence in a decode batch of this size."""
        return batch_size / self.decode.at(batch_size)

    def refine(self, observations: Iterable[CapacityObservation] = (), startup_s: float | None = None,
               alpha: float = DEFAULT_REFINE_ALPHA) -> CapacityProfile:
        """A new profile moved toward the observations (and an observed start-up time)."""
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be within (0, 1], got {alpha}")
        prefill, decode = self.prefill, self.decode
        for obs in observations:
            if obs.kind is CapacityKind.PREFILL:
                prefill = prefill.refined(obs.x, obs.tokens_per_s, alpha)
            else:
                decode = decode.refined(obs.x, obs.tokens_per_s, alpha)
        startup = self.startup_s if startup_s is None else (1 - alpha) * self.startup_s + alpha * startup_s
        return replace(self, prefill=prefill, decode=decode, startup_s=startup)


def observations_from_sample(sample: MetricsSample, previous: MetricsSample | None = None) -> list[CapacityObservation]:
    """The capacity measurements hidden in one interval's worker counters (module header);
    `previous` is the sample before, which tells a prefill worker busy throughout."""
    before = {w.worker_id: w for w in previous.workers} if previous is not None else {}
    observations = []
    for w in sample.workers:
        if w.role == "decode" and w.num_running_decodes > 0 and w.num_generated_tokens > 0 \
                and w.num_prompt_tokens_computed == 0:
            observations.append(CapacityObservation(CapacityKind.DECODE, w.num_running_decodes,
                                                    w.num_generated_tokens / sample.interval_s))
        elif w.role == "prefill" and w.prefill_queue_tokens > 0 and sample.prompt_tokens_mean > 0:
            queued_before = w.worker_id in before and before[w.worker_id].prefill_queue_tokens > 0
            if w.num_prompt_tokens_computed > 0 or queued_before:
                observations.append(CapacityObservation(CapacityKind.PREFILL, sample.prompt_tokens_mean,
                                                        w.num_prompt_tokens_computed / sample.interval_s))
    return observations
