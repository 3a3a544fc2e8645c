"""`ScalingLoop`: one deployment's SLO autoscaling, the same for `serve --autoscale` and the operator.

`step()`, called often (serve: every 0.5 s; the operator: at the latest when an interval is due),
does what is due:

- the first call reads the baseline: the counts asked for and a sample, which is dropped
  whatever it is (a scraping source only remembers its counters; the first interval is the
  difference from them);
- then, every `interval_s`, one interval (`interval()`):
  1. the counts asked for (`ScaleActuator.read_replicas`; None skips the interval);
  2. the interval's sample (`SampleSource.sample`; None skips it, and so does a sample no
     newer than the last one);
  3. `Planner.decide(history, sample)`, then `Planner.learned` (the profile refined by what the
     interval measured, a mode's sustained miss remembered) and the sample into the history,
     which holds max(cool-down, window) of samples plus a few;
  4. the decision logged (`DecisionLog`): a line (serve's console, the operator's log) and the
     planner metrics when the deployment has them (planner/decision_metrics.py);
  5. `ScaleActuator.apply(decision)` when the counts changed;
  6. `DecisionReporter.report(decision)` (the operator's Event and status.autoscaling).

An interval that raises (an apiserver refusal, a worker start that failed) goes to
`DecisionReporter.report_failure` and the loop goes on: autoscaling must never take serving
down, and the next interval reads the counts afresh. Cool-downs, the dead band and mode
choice are the planner's, read from the samples' counts; the mechanics of a mode switch
(local workers moved or replaced one place at a time, two ServingPool patches) are the
actuator's.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.services.autoscaling.seams import DecisionReporter, MetricsRecorder, SampleSource, ScaleActuator
from splitserve.services.planner import Decision, MetricsSample, Planner, PlannerConfig

log = logging.getLogger(__name__)

HISTORY_SPARE = 4                # samples kept beyond max(cool-down, window)


def history_length(config: PlannerConfig, interval_s: float) -> int:
    """The samples the planner reads at most: max(cool-down, window) of them, and a few more."""
    return math.ceil(max(config.cooldown_s, config.window_s) / interval_s) + HISTORY_SPARE


@dataclass(frozen=True, slots=True)
class DecisionLog:
    """Where a deployment's decisions are told: one line each (`prefix` + `Decision.explain()`)
    through `say`, and the planner metrics labelled `deployment` when `metrics` is set."""

    say: Callable[[str], None]
    prefix: str                              # "autoscale: " (serve), "autoscale NAMESPACE/NAME: " (operator)
    deployment: str                          # the metrics' label: "serve", "NAMESPACE/NAME"
    metrics: MetricsRecorder | None = None

    def record(self, decision: Decision) -> None:
        self.say(f"{self.prefix}{decision.explain()}")
        if self.metrics is not None:
            self.metrics.record(self.deployment, decision)


class ScalingLoop:
    def __init__(self, planner: Planner, interval_s: float, source: SampleSource, actuator: ScaleActuator,
                 reporter: DecisionReporter, decision_log: DecisionLog, clock: Callable[[], float] = time.monotonic):
        self.planner = planner
        self.interval_s = interval_s
        self.source = source
        self.actuator = actuator
        self.reporter = reporter
        self.decision_log = decision_log
        self.clock = clock
        self.history: deque[MetricsSample] = deque(maxlen=history_length(planner.config, interval_s))
        self.next_due: float | None = None        # None: the baseline is still to read
        self.last_decision: Decision | None = None
        self.num_decisions = 0

    def seconds_to_due(self) -> float:
        """How long until `step()` has something to do (0: now)."""
        return 0.0 if self.next_due is None else max(0.0, self.next_due - self.clock())

    async def step(self) -> Decision | None:
        """The baseline on the first call, then an interval each time one is due (module header);
        the interval's decision, else None."""
        now = self.clock()
        if self.next_due is not None and now < self.next_due:
            return None
        baseline = self.next_due is None
        self.next_due = now + self.interval_s
        try:
            if baseline:
                await self.read_baseline()
                return None
            return await self.interval()
        except Exception as exc:  # noqa: BLE001 - the deployment keeps what it runs; the next interval retries
            await self.reporter.report_failure(exc)
            return None

    async def read_baseline(self) -> None:
        replicas = await self.actuator.read_replicas()
        if replicas is not None:
            await self.source.sample(replicas)      # dropped: the first interval starts here

    async def interval(self) -> Decision | None:
        """One planning interval (module header, 1-6); its decision, or None without a sample."""
        replicas = await self.actuator.read_replicas()
        if replicas is None:
            return None
        sample = await self.source.sample(replicas)
        if sample is None:
            return None
        if self.history and sample.timestamp <= self.history[-1].timestamp:
            log.warning("%sa sample older than the last one, ignored", self.decision_log.prefix)
            return None
        decision = self.planner.decide(self.history, sample)
        self.planner = self.planner.learned(self.history, sample)
        self.history.append(sample)
        self.last_decision = decision
        self.num_decisions += 1
        self.decision_log.record(decision)
        if decision.changed:
            await self.actuator.apply(decision)
        await self.reporter.report(decision)
        return decision

    # -- what the deployment learns or changes between intervals -----------------------------
    def refine_startup(self, startup_s: float) -> None:
        """A worker the actuator started turned ready after `startup_s`: the profile's start-up
        time moves toward it (the planner plans for the load a start-up from now)."""
        self.planner = self.planner.with_profile(self.planner.profile.refine(startup_s=startup_s))

    def reconfigure(self, planner: Planner, interval_s: float) -> None:
        """A new config (and perhaps profile): the history stays; the next interval comes no
        later than one new interval from now."""
        self.planner = planner
        self.interval_s = interval_s
        self.history = deque(self.history, maxlen=history_length(planner.config, interval_s))
        if self.next_due is not None:
            self.next_due = min(self.next_due, self.clock() + interval_s)
