"""Helpers for the planner's tests: a fixed capacity profile and a closed-loop replay.

`replay` feeds a planner one sample per interval, built from a scripted load, puts each
decision's counts into the next sample and lets the planner learn from the interval, as
the `serve --autoscale` loop does.
Timestamps are explicit: nothing sleeps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from splitserve.services.planner import (CapacityProfile, Decision, MetricsSample, Planner, PlannerConfig,
                                         PoolBounds, ReplicaCounts, SloTargets, ThroughputCurve)

INTERVAL_S = 10.0
SLO = SloTargets(ttft_p90_s=1.0, itl_p90_s=0.05)


def make_profile(startup_s: float = 60.0, kv_capacity_tokens: int | None = None) -> CapacityProfile:
    """A GPU-like worker: prefill peaks near 2k-token prompts; ITL 25 ms alone, 50 ms near batch 54."""
    return CapacityProfile(
        prefill=ThroughputCurve(((128, 4000.0), (512, 8000.0), (2048, 10000.0), (8192, 9000.0))),
        decode=ThroughputCurve(((1, 40.0), (8, 280.0), (32, 800.0), (64, 1200.0), (128, 1600.0))),
        startup_s=startup_s, kv_capacity_tokens=kv_capacity_tokens)


def make_config(**overrides) -> PlannerConfig:
    settings = dict(slo=SLO, prefill=PoolBounds(1, 8), decode=PoolBounds(1, 8), aggregated=PoolBounds(1, 8),
                    max_workers=16)
    settings.update(overrides)
    return PlannerConfig(**settings)


@dataclass(frozen=True)
class Load:
    """The traffic of one interval."""

    num_arrivals: int
    prompt_tokens: float
    output_tokens: float
    ttft_p90_s: float | None = 0.4          # healthy unless a test says otherwise
    itl_p90_s: float | None = 0.02
    frontend_queue_depth: int = 0


def steady(seconds: float, rate: float, prompt_tokens: float, output_tokens: float) -> list[Load]:
    """`seconds` of a constant request rate."""
    return [Load(round(rate * INTERVAL_S), prompt_tokens, output_tokens)] * round(seconds / INTERVAL_S)


def sample_of(timestamp: float, load: Load, replicas: ReplicaCounts) -> MetricsSample:
    return MetricsSample(timestamp=timestamp, interval_s=INTERVAL_S, num_arrivals=load.num_arrivals,
                         prompt_tokens_mean=load.prompt_tokens, prompt_tokens_p90=1.5 * load.prompt_tokens,
                         output_tokens_mean=load.output_tokens, replicas=replicas, ttft_p90_s=load.ttft_p90_s,
                         itl_p90_s=load.itl_p90_s, frontend_queue_depth=load.frontend_queue_depth)


def replay(planner: Planner, loads: Iterable[Load], start: ReplicaCounts) -> list[Decision]:
    """Every decision of a closed loop over `loads`, one interval each, starting at `start`."""
    history: list[MetricsSample] = []
    replicas, decisions = start, []
    for i, load in enumerate(loads):
        sample = sample_of((i + 1) * INTERVAL_S, load, replicas)
        decision = planner.decide(history, sample)
        planner = planner.learned(history, sample)
        decisions.append(decision)
        replicas = decision.replicas
        history.append(sample)
    return decisions


def counts(decisions: list[Decision], pool: str) -> list[int]:
    return [d.replicas.count(pool) for d in decisions]
