"""The load to plan for: the next interval's arrivals and length mix, from the recent samples.

Over the samples of the last `window_s` seconds (oldest first; r_i = arrivals_i / interval_i):

    level    = max(EWMA_alpha(r_i), r_last)   rises at once with a step, falls as the EWMA
    trend    = (mean r of the newer half - mean r of the older half)
               / (time between the halves' mean timestamps)
               only for a ramp: each half's last rate above its first, and the newer
               half's mean above the older's, by more than g = (1 + dead_band) /
               (1 - dead_band), the largest ratio noise of +-dead_band around a steady
               rate can make (at least 4 samples needed). A step is no ramp: one half
               of the window is flat, and extrapolating it would overshoot.
    rate(h)  = level + trend * h              predicted h seconds ahead

The planner asks for h = the worker start-up time, so a rising load is met by workers
that are ready when it arrives. A falling trend is never extrapolated: scaling down
waits for the cool-down instead.

Length mix: arrival-weighted means of the window's prompt and output means; the prompt
p90 is the largest of the window's p90s (the TTFT tail is set by long prompts). A window
without arrivals keeps the last lengths seen anywhere in the samples.

Observed now (the latest sample): the backlog (the frontend's queued requests times the
mean prompt, plus the workers' queued prefill tokens), the running decodes and the decode
workers' KV in use. `observed(sample)` is one sample's own load without smoothing, which
the planner reads for every sample of its cool-down window.

Parameters: window_s (60 s), ewma_alpha (0.5), dead_band (0.15; the planner's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from splitserve.services.planner.samples import MetricsSample


@dataclass(frozen=True, slots=True)
class PredictedLoad:
    horizon_s: float                # how far ahead of the latest sample this is
    arrival_rate: float             # requests/s
    prompt_tokens_mean: float
    prompt_tokens_p90: float
    output_tokens_mean: float
    backlog_tokens: float           # prompt tokens already waiting (queued requests' and workers' queues)
    num_running_decodes: float      # observed at the latest sample
    decode_kv_usage: float          # observed Σ kv_usage of the decoding workers, in workers' worth of KV
    trend_per_s: float = 0.0        # the rise of the rate per second that was extrapolated (0: none)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.arrival_rate * self.prompt_tokens_mean

    @property
    def decode_tokens_per_s(self) -> float:
        return self.arrival_rate * self.output_tokens_mean

    def scaled(self, factor: float) -> PredictedLoad:
        """The same mix with every load term times `factor` (rate, backlog, running decodes, KV)."""
        return replace(self, arrival_rate=self.arrival_rate * factor, backlog_tokens=self.backlog_tokens * factor,
                       num_running_decodes=self.num_running_decodes * factor,
                       decode_kv_usage=self.decode_kv_usage * factor)


@dataclass(frozen=True, slots=True)
class LoadPredictor:
    window_s: float = 60.0
    ewma_alpha: float = 0.5
    dead_band: float = 0.15

    def __post_init__(self) -> None:
        if self.window_s <= 0 or not 0.0 < self.ewma_alpha <= 1.0 or not 0.0 <= self.dead_band < 1.0:
            raise ValueError(f"bad predictor parameters: {self}")

    @property
    def noise_ratio(self) -> float:
        """g: the largest ratio of two rates that noise within the dead band can make."""
        return (1 + self.dead_band) / (1 - self.dead_band)

    def predict(self, samples: Sequence[MetricsSample], horizon_s: float = 0.0) -> PredictedLoad:
        """The load `horizon_s` after the last sample. `samples`: oldest first, at least one."""
        if not samples:
            raise ValueError("predict needs at least the current sample")
        latest = samples[-1]
        window = [s for s in samples if s.timestamp > latest.timestamp - self.window_s] or [latest]
        rates = [s.arrival_rate for s in window]
        ewma = rates[0]
        for r in rates[1:]:
            ewma += self.ewma_alpha * (r - ewma)
        level = max(ewma, rates[-1])
        trend = self._trend(window, rates)
        prompt_mean, prompt_p90, output_mean = _length_mix(window, samples)
        return PredictedLoad(
            horizon_s=horizon_s, arrival_rate=level + trend * horizon_s,
            prompt_tokens_mean=prompt_mean, prompt_tokens_p90=prompt_p90, output_tokens_mean=output_mean,
            backlog_tokens=_backlog_tokens(latest, prompt_mean),
            num_running_decodes=latest.num_running_decodes, decode_kv_usage=latest.decode_kv_usage,
            trend_per_s=trend)

    def observed(self, sample: MetricsSample) -> PredictedLoad:
        """One sample's own load: its rate and lengths, no smoothing, no horizon."""
        return PredictedLoad(
            horizon_s=0.0, arrival_rate=sample.arrival_rate, prompt_tokens_mean=sample.prompt_tokens_mean,
            prompt_tokens_p90=sample.prompt_tokens_p90, output_tokens_mean=sample.output_tokens_mean,
            backlog_tokens=_backlog_tokens(sample, sample.prompt_tokens_mean),
            num_running_decodes=sample.num_running_decodes, decode_kv_usage=sample.decode_kv_usage)

    def _trend(self, window: list[MetricsSample], rates: list[float]) -> float:
        if len(window) < 4:
            return 0.0
        half = len(window) // 2
        older, newer = rates[:half], rates[half:]
        older_mean, newer_mean = sum(older) / len(older), sum(newer) / len(newer)
        g = self.noise_ratio
        if older[-1] <= older[0] * g or newer[-1] <= newer[0] * g or newer_mean <= older_mean * g:
            return 0.0
        older_t = sum(s.timestamp for s in window[:half]) / half
        newer_t = sum(s.timestamp for s in window[half:]) / (len(window) - half)
        return (newer_mean - older_mean) / (newer_t - older_t)


def _length_mix(window: list[MetricsSample], samples: Sequence[MetricsSample]) -> tuple[float, float, float]:
    """(prompt mean, prompt p90, output mean): arrival-weighted over the window (module header)."""
    weighted = [s for s in window if s.num_arrivals > 0]
    if not weighted:
        earlier = [s for s in samples if s.num_arrivals > 0]
        if not earlier:
            last = samples[-1]
            return last.prompt_tokens_mean, last.prompt_tokens_p90, last.output_tokens_mean
        weighted = earlier[-1:]
    total = sum(s.num_arrivals for s in weighted)
    prompt_mean = sum(s.prompt_tokens_mean * s.num_arrivals for s in weighted) / total
    output_mean = sum(s.output_tokens_mean * s.num_arrivals for s in weighted) / total
    prompt_p90 = max(max(s.prompt_tokens_p90 for s in weighted), prompt_mean)
    return prompt_mean, prompt_p90, output_mean


def _backlog_tokens(sample: MetricsSample, prompt_mean: float) -> float:
    return sample.frontend_queue_depth * prompt_mean + sample.prefill_queue_tokens
