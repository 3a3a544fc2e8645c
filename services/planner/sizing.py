"""How many workers a load needs: an explicit queueing model, one pure function per kind of pool.

Notation: load lambda req/s, mean prompt P, p90 prompt P90, mean output O (predictor.py);
the profile's prefill(P) and decode(b) tokens/s (profile.py); t(b) = b / decode(b), the
per-token time at batch b, made non-decreasing in b; U = max_utilisation; targets TTFT, ITL.

Prefill pool (disaggregated), n workers, each an M/M/1 queue of prompts (the router spreads them):
    mu   = prefill(P)                            one worker's prompt tokens/s
    R    = lambda * P + backlog / backlog_drain_s
    rho  = R / (n * mu),  S = P / mu,  S90 = P90 / prefill(P90)
    W90  = S * max(0, ln(10 * rho)) / (1 - rho)  the M/M/1 p90 wait (P(W > t) = rho * e^(-(1 - rho) t / S))
    need rho <= U ("utilisation") and W90 + S90 <= TTFT ("ttft"): n = ceil(R / (mu * rho*)),
    rho* = min(U, the largest rho with W90 + S90 <= TTFT). When S90 > TTFT no n meets it
    (reachable = False) and rho* = U: more workers cannot shorten one prompt.

Decode pool (disaggregated), n workers:
    B*   = the largest b <= max_batch with t(b) <= ITL      (none: reachable = False, B* = 1)
    n >= lambda * O / (U * decode(B*))        ("itl": the token rate, at the largest batch that meets ITL)
    n >= running decodes / B*                 ("itl": the decodes running now fit in batches of B*)
    n >= sum(kv_usage) / kv_fraction          ("kv": the KV in use now fits under the ceiling)
    n >= C * (P + O / 2) / (kv_fraction * kv_capacity_tokens), C = max(lambda * O * t(B*), running)
                                              ("kv", when the profile knows its KV size: Little's law)

Aggregated pool (each worker interleaves prefill chunks with decode steps), the smallest n with:
    f_p = R / (n * mu)                        prefill's share of a worker's time, < U ("utilisation")
    B   = the largest b with t(b) / (1 - f_p) <= ITL, B >= running / n   ("itl": prefill stretches steps)
    f_d = lambda * O / (n * decode(B)),  f_p + f_d <= U                  ("utilisation")
    W90 + S90 <= TTFT with prefill at mu * (1 - f_d)                     ("ttft")
    the two KV bounds above with t(B) / (1 - f_p)                        ("kv")
  A target no n can meet (S90 > TTFT, or t(1) > ITL) is dropped from the search and the pool
  reported unreachable; the binding is the constraint that failed at n - 1.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import lru_cache

from splitserve.services.planner.config import PlannerConfig, SloTargets
from splitserve.services.planner.decision import Binding
from splitserve.services.planner.predictor import PredictedLoad
from splitserve.services.planner.profile import CapacityProfile

_EPSILON = 1e-9            # a count computed as 2.0000000001 is 2


@dataclass(frozen=True, slots=True)
class PoolNeed:
    count: int                # may be 0 (no load) or above any bound: the planner clamps
    binding: Binding          # the constraint that set `count` (MIN: one worker is more than enough)
    reachable: bool = True    # False: no count meets the SLO at this load
    detail: str = ""


def p90_wait(service_s: float, rho: float) -> float:
    """The p90 queueing delay of an M/M/1 queue with mean service time `service_s` at utilisation rho."""
    if rho >= 1.0:
        return math.inf
    if rho <= 0.1:
        return 0.0
    return service_s * math.log(10.0 * rho) / (1.0 - rho)


@lru_cache(maxsize=4096)
def max_utilisation_for_wait(service_s: float, slack_s: float) -> float:
    """The largest rho < 1 whose p90 wait is within `slack_s` (bisection; p90_wait grows with rho)."""
    if service_s <= 0.0:
        return 1.0
    lo, hi = 0.1, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if p90_wait(service_s, mid) <= slack_s:
            lo = mid
        else:
            hi = mid
    return lo


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - _EPSILON))


@dataclass(frozen=True, slots=True)
class BatchLatencies:
    """t(b) for b = 1..max_batch, made non-decreasing, so the largest batch within a latency is a bisection."""

    token_seconds: tuple[float, ...]

    @classmethod
    def of(cls, profile: CapacityProfile, max_batch: int) -> BatchLatencies:
        worst, out = 0.0, []
        for b in range(1, max_batch + 1):
            worst = max(worst, profile.token_seconds(b))
            out.append(worst)
        return cls(tuple(out))

    def largest_batch_within(self, seconds: float) -> int:
        """The largest batch whose per-token time is within `seconds`; 0 when even batch 1's is not."""
        return bisect.bisect_right(self.token_seconds, seconds)


@dataclass(frozen=True, slots=True)
class SizingModel:
    profile: CapacityProfile
    slo: SloTargets
    max_utilisation: float
    kv_fraction: float
    backlog_drain_s: float
    batches: BatchLatencies

    @classmethod
    def of(cls, profile: CapacityProfile, config: PlannerConfig) -> SizingModel:
        return cls(profile, config.slo, config.max_utilisation, config.kv_fraction, config.backlog_drain_s,
                   BatchLatencies.of(profile, config.max_batch))

    def _prefill_demand(self, load: PredictedLoad) -> float:
        return load.prefill_tokens_per_s + load.backlog_tokens / self.backlog_drain_s

    def _kv_count(self, load: PredictedLoad, token_seconds: float) -> int:
        count = _ceil(load.decode_kv_usage / self.kv_fraction)
        capacity = self.profile.kv_capacity_tokens
        if capacity:
            concurrent = max(load.decode_tokens_per_s * token_seconds, load.num_running_decodes)
            context = load.prompt_tokens_mean + load.output_tokens_mean / 2
            count = max(count, _ceil(concurrent * context / (self.kv_fraction * capacity)))
        return count

    def prefill(self, load: PredictedLoad) -> PoolNeed:
        mu = self.profile.prefill.at(load.prompt_tokens_mean)
        demand = self._prefill_demand(load)
        slack = self.slo.ttft_p90_s - self.profile.prefill_seconds(load.prompt_tokens_p90)
        reachable = slack >= 0
        rho_ttft = max_utilisation_for_wait(load.prompt_tokens_mean / mu, slack) if reachable else 1.0
        if rho_ttft < self.max_utilisation:
            rho, binding = rho_ttft, Binding.TTFT
        else:
            rho, binding = self.max_utilisation, Binding.UTILISATION if reachable else Binding.TTFT
        count = _ceil(demand / (mu * rho))
        return PoolNeed(count, binding, reachable,
                        f"{demand:.0f} prompt tok/s at {mu:.0f} per worker, utilisation <= {rho:.2f}")

    def decode(self, load: PredictedLoad) -> PoolNeed:
        best = self.batches.largest_batch_within(self.slo.itl_p90_s)
        batch = max(best, 1)
        tokens_per_s = self.profile.decode.at(batch)
        itl_count = _ceil(max(load.decode_tokens_per_s / (self.max_utilisation * tokens_per_s),
                              load.num_running_decodes / batch))
        kv_count = self._kv_count(load, self.batches.token_seconds[batch - 1])
        binding = Binding.KV if kv_count > itl_count else Binding.ITL
        return PoolNeed(max(itl_count, kv_count), binding, best > 0,
                        f"{load.decode_tokens_per_s:.0f} output tok/s at {tokens_per_s:.0f} per worker, "
                        f"batch <= {batch}")

    def aggregated(self, load: PredictedLoad, limit: int) -> PoolNeed:
        """The smallest count up to `limit` that meets every constraint; limit + 1 when none does."""
        mu = self.profile.prefill.at(load.prompt_tokens_mean)
        demand = self._prefill_demand(load)
        service_s = load.prompt_tokens_mean / mu
        service_p90_s = self.profile.prefill_seconds(load.prompt_tokens_p90)
        ttft_reachable = service_p90_s <= self.slo.ttft_p90_s
        itl_reachable = self.batches.token_seconds[0] <= self.slo.itl_p90_s
        failed = Binding.MIN
        for n in range(1, limit + 1):
            f_p = demand / (n * mu)
            if f_p >= self.max_utilisation:
                failed = Binding.UTILISATION
                continue
            batch = self.batches.largest_batch_within(self.slo.itl_p90_s * (1 - f_p)) if itl_reachable else 1
            if batch == 0 or (itl_reachable and load.num_running_decodes / n > batch):
                failed = Binding.ITL
                continue
            f_d = load.decode_tokens_per_s / (n * self.profile.decode.at(batch))
            if f_p + f_d > self.max_utilisation:
                failed = Binding.UTILISATION
                continue
            share = 1.0 - f_d
            if ttft_reachable and \
                    p90_wait(service_s / share, f_p / share) + service_p90_s / share > self.slo.ttft_p90_s:
                failed = Binding.TTFT
                continue
            if self._kv_count(load, self.batches.token_seconds[batch - 1] / (1 - f_p)) > n:
                failed = Binding.KV
                continue
            return PoolNeed(n, failed, ttft_reachable and itl_reachable,
                            f"prefill share {f_p:.2f}, decode share {f_d:.2f}, batch <= {batch}")
        return PoolNeed(limit + 1, failed, ttft_reachable and itl_reachable, f"no count up to {limit} suffices")
