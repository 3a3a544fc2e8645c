"""What the planner aims for and the limits it keeps: SLO targets, pool bounds, its knobs.

`PlannerConfig` fields (defaults in brackets):

- slo: `SloTargets(ttft_p90_s, itl_p90_s)`, the p90 time to first token and inter-token latency.
- prefill, decode, aggregated: `PoolBounds(min_replicas, max_replicas)` per pool [1, 4 / 1, 4 / 1, 8]
  (the aggregated pool is the one pool of an aggregated deployment).
- max_workers: the most workers of the whole deployment [8].
- mode: `PlannerMode` AUTO (choose disaggregated or aggregated), DISAGGREGATED, AGGREGATED [AUTO].
- max_utilisation: the busy share of a worker's time the model plans for, its headroom [0.8].
- kv_fraction: the share of a decode worker's KV the model plans to fill [0.9].
- max_batch: the largest decode batch the model considers [256].
- dead_band: the relative noise in the load that must not change a count [0.15]; a count
  goes down only when it is enough for every sample of the cool-down window at
  (1 + dead_band) / (1 - dead_band) times that sample's load.
- cooldown_s: the time after any change of a pool before it may shrink, and the window
  whose every sample must agree that it can [300].
- backlog_drain_s: a backlog already waiting is to be cleared within this time [30].
- mode_switch_saving: replicas the other mode must save, over the whole cool-down window,
  before AUTO switches to it [1].
- mode_memory_s: how long a mode's observed miss with all its workers (mode_misses.py) keeps
  AUTO from switching to it at that load or a heavier one [1800].
- window_s, ewma_alpha: the load predictor's (predictor.py) [60 s, 0.5].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


@dataclass(frozen=True, slots=True)
class SloTargets:
    ttft_p90_s: float
    itl_p90_s: float

    def __post_init__(self) -> None:
        if self.ttft_p90_s <= 0 or self.itl_p90_s <= 0:
            raise ValueError(f"SLO targets must be > 0, got {self}")


@dataclass(frozen=True, slots=True)
class PoolBounds:
    min_replicas: int = 1
    max_replicas: int = 4

    def __post_init__(self) -> None:
        if self.min_replicas < 1 or self.max_replicas < self.min_replicas:
            raise ValueError(f"pool bounds need 1 <= min_replicas <= max_replicas, got {self}")

    def clamp(self, count: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, count))


class PlannerMode(Enum):
    AUTO = "auto"
    DISAGGREGATED = "disaggregated"
    AGGREGATED = "aggregated"


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    slo: SloTargets
    prefill: PoolBounds = field(default_factory=PoolBounds)
    decode: PoolBounds = field(default_factory=PoolBounds)
    aggregated: PoolBounds = field(default_factory=lambda: PoolBounds(1, 8))
    max_workers: int = 8
    mode: PlannerMode = PlannerMode.AUTO
    max_utilisation: float = 0.8
    kv_fraction: float = 0.9
    max_batch: int = 256
    dead_band: float = 0.15
    cooldown_s: float = 300.0
    backlog_drain_s: float = 30.0
    mode_switch_saving: int = 1
    mode_memory_s: float = 1800.0
    window_s: float = 60.0
    ewma_alpha: float = 0.5

    def __post_init__(self) -> None:
        if self.mode is not PlannerMode.AGGREGATED and \
                self.prefill.min_replicas + self.decode.min_replicas > self.max_workers:
            raise ValueError(f"max_workers ({self.max_workers}) is below the prefill and decode minimums")
        if self.mode is not PlannerMode.DISAGGREGATED and self.aggregated.min_replicas > self.max_workers:
            raise ValueError(f"max_workers ({self.max_workers}) is below the aggregated minimum")
        if not 0.0 < self.max_utilisation < 1.0 or not 0.0 < self.kv_fraction <= 1.0:
            raise ValueError("max_utilisation must be within (0, 1) and kv_fraction within (0, 1]")
        if not 0.0 <= self.dead_band < 1.0:
            raise ValueError(f"dead_band must be within [0, 1), got {self.dead_band}")
        if self.max_batch < 1 or self.cooldown_s < 0 or self.backlog_drain_s <= 0 or self.mode_switch_saving < 0 \
                or self.mode_memory_s < 0:
            raise ValueError("max_batch >= 1, cooldown_s >= 0, backlog_drain_s > 0, mode_switch_saving >= 0, "
                             "mode_memory_s >= 0")

    def bounds(self, pool: str) -> PoolBounds:
        if pool == "prefill":
            return self.prefill
        if pool == "decode":
            return self.decode
        if pool == "aggregated":
            return self.aggregated
        raise ValueError(f"unknown pool {pool!r}; pools: prefill, decode, aggregated")

    @property
    def noise_ratio(self) -> float:
        """g = (1 + dead_band) / (1 - dead_band)."""
        return (1 + self.dead_band) / (1 - self.dead_band)
