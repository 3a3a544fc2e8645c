"""The shared autoscaling loop (services/autoscaling) on a fake deployment: a fake source and a fake
actuator implement the seams and stand in for serve's processes or the operator's ServingPools.
The clock is the test's; nothing sleeps."""

from __future__ import annotations

import ast
import asyncio
import sys
from pathlib import Path

import splitserve.services.autoscaling as autoscaling
from splitserve.services.autoscaling import (DecisionLog, DecisionReporter, SampleSource, ScaleActuator, ScalingLoop,
                                             history_length)
from splitserve.services.planner import (CapacityProfile, Decision, MetricsSample, Planner, PlannerConfig,
                                         PlannerMode, PoolBounds, ReplicaCounts, SloTargets, ThroughputCurve)

QUIET, BUSY = 1, 10          # arrivals per 1 s interval: the decode pool needs 1 worker, then 3
COOLDOWN_S = 5.0


def planner(**config) -> Planner:
    settings = dict(prefill=PoolBounds(1, 4), decode=PoolBounds(1, 4), aggregated=PoolBounds(1, 4), max_workers=6,
                    mode=PlannerMode.DISAGGREGATED, cooldown_s=COOLDOWN_S, window_s=60.0)
    settings.update(config)
    profile = CapacityProfile(ThroughputCurve(((1024.0, 10000.0),)), ThroughputCurve(((10.0, 100.0),)),
                              startup_s=0.0)
    return Planner(PlannerConfig(SloTargets(1.0, 0.1), **settings), profile)


class FakeSource:
    """Stands in for a scrape: one sample per call from a script of arrivals, at t = 1, 2, ...; the
    first is the baseline's, which the loop drops. A None in the script is a call without a
    sample; `stale` repeats the last timestamp."""

    def __init__(self, arrivals):
        self.arrivals = list(arrivals)
        self.t = 0.0
        self.calls: list[ReplicaCounts] = []
        self.stale = False

    async def sample(self, replicas: ReplicaCounts) -> MetricsSample | None:
        self.calls.append(replicas)
        if not self.stale:
            self.t += 1.0
        n = self.arrivals.pop(0) if self.arrivals else None
        if n is None:
            return None
        return MetricsSample(timestamp=self.t, interval_s=1.0, num_arrivals=n, prompt_tokens_mean=100,
                             prompt_tokens_p90=100, output_tokens_mean=20, replicas=replicas, ttft_p90_s=0.2,
                             itl_p90_s=0.05)


class FakeActuator:
    """Stands in for processes or ServingPools: the counts asked for are the last applied."""

    def __init__(self, replicas: ReplicaCounts | None = ReplicaCounts.of_pools(1, 1)):
        self.replicas = replicas
        self.applied: list[ReplicaCounts] = []
        self.failure: Exception | None = None

    async def read_replicas(self) -> ReplicaCounts | None:
        return self.replicas

    async def apply(self, decision: Decision) -> None:
        if self.failure is not None:
            raise self.failure
        self.applied.append(decision.replicas)
        self.replicas = decision.replicas


class FakeReporter:
    def __init__(self):
        self.reported: list[Decision] = []
        self.failures: list[Exception] = []

    async def report(self, decision: Decision) -> None:
        self.reported.append(decision)

    async def report_failure(self, exc: Exception) -> None:
        self.failures.append(exc)


class FakeMetrics:
    def __init__(self):
        self.records: list[tuple[str, Decision]] = []

    def record(self, deployment: str, decision: Decision) -> None:
        self.records.append((deployment, decision))


def make(arrivals, actuator: FakeActuator | None = None, **config):
    clock = [0.0]
    lines: list[str] = []
    source, reporter, metrics = FakeSource(arrivals), FakeReporter(), FakeMetrics()
    actuator = actuator or FakeActuator()
    loop = ScalingLoop(planner(**config), 1.0, source, actuator, reporter,
                       DecisionLog(lines.append, "autoscale test: ", "ns/test", metrics), clock=lambda: clock[0])
    return loop, clock, source, actuator, reporter, lines, metrics


def run(coro):
    return asyncio.run(coro)


def steps(loop: ScalingLoop, clock: list[float], until: float) -> list[Decision]:
    """step() every 0.25 s of the test's clock up to `until`; the decisions made."""
    decisions = []
    while clock[0] <= until:
        decision = run(loop.step())
        if decision is not None:
            decisions.append(decision)
        clock[0] += 0.25
    return decisions


def test_the_fakes_implement_the_seams():
    # Protocols are structural; this names the contract the fakes stand in for.
    source: SampleSource = FakeSource([])
    actuator: ScaleActuator = FakeActuator()
    reporter: DecisionReporter = FakeReporter()
    assert source and actuator and reporter


def test_the_first_step_reads_a_baseline_then_one_interval_is_due_each_interval_s():
    loop, clock, source, _, reporter, lines, _ = make([QUIET] * 4)
    assert loop.seconds_to_due() == 0.0
    assert run(loop.step()) is None                      # the baseline: read, and dropped
    assert len(source.calls) == 1 and loop.num_decisions == 0 and not loop.history
    assert loop.seconds_to_due() == 1.0
    assert run(loop.step()) is None and len(source.calls) == 1      # not due yet
    clock[0] = 1.0
    decision = run(loop.step())
    assert decision is not None and decision.replicas == ReplicaCounts.of_pools(1, 1)
    assert loop.num_decisions == 1 and list(loop.history) == [decision.inputs] and loop.last_decision is decision
    assert reporter.reported == [decision] and not reporter.failures
    decisions = steps(loop, clock, 3.0)
    assert len(decisions) == 2 and loop.num_decisions == 3 and len(source.calls) == 4


def test_a_step_up_is_applied_and_the_next_sample_reads_the_counts_asked_for():
    loop, clock, source, actuator, reporter, lines, metrics = make([QUIET, QUIET, QUIET, BUSY, BUSY])
    decisions = steps(loop, clock, 4.0)
    assert [d.replicas.num_decode for d in decisions] == [1, 1, 3, 3]
    assert actuator.applied == [ReplicaCounts.of_pools(1, 3)]               # only the change
    assert source.calls[-1] == ReplicaCounts.of_pools(1, 3) and decisions[-1].current == ReplicaCounts.of_pools(1, 3)
    assert reporter.reported == decisions
    # Told: one line and one metrics record per decision, before its apply.
    assert lines == [f"autoscale test: {d.explain()}" for d in decisions]
    assert "1P+1D -> 1P+3D" in lines[2]
    assert metrics.records == [("ns/test", d) for d in decisions]


def test_quiet_after_the_cooldown_scales_down():
    arrivals = [QUIET, QUIET, BUSY] + [QUIET] * 10       # the baseline's first
    loop, clock, _, actuator, _, _, _ = make(arrivals)
    decisions = steps(loop, clock, float(len(arrivals)))
    assert decisions[1].replicas.num_decode == 3
    down = next(i for i, d in enumerate(decisions) if i > 1 and d.replicas.num_decode < 3)
    assert down - 1 >= COOLDOWN_S                        # not before the cool-down since the step up
    assert actuator.applied == [ReplicaCounts.of_pools(1, 3), decisions[down].replicas]


def test_no_counts_or_no_sample_skips_the_interval():
    loop, clock, source, actuator, reporter, _, _ = make([None, QUIET], actuator=FakeActuator(None))
    run(loop.step())                                      # baseline: nothing to scale, nothing read
    assert source.calls == []
    clock[0] = 1.0
    assert run(loop.step()) is None and source.calls == []          # still nothing to scale
    actuator.replicas = ReplicaCounts.of_pools(1, 1)
    clock[0] = 2.0
    assert run(loop.step()) is None and len(source.calls) == 1      # the source had none this time
    clock[0] = 3.0
    assert run(loop.step()) is not None
    assert loop.num_decisions == 1 and len(loop.history) == 1 and not reporter.failures


def test_a_sample_no_newer_than_the_last_is_dropped():
    loop, clock, source, _, reporter, _, _ = make([QUIET] * 4)
    steps(loop, clock, 2.0)
    assert loop.num_decisions == 2
    source.stale = True
    clock[0] = 3.0
    assert run(loop.step()) is None
    assert loop.num_decisions == 2 and len(loop.history) == 2 and len(reporter.reported) == 2


def test_a_failing_interval_is_reported_and_the_loop_goes_on():
    actuator = FakeActuator()
    loop, clock, _, actuator, reporter, _, _ = make([QUIET, QUIET, BUSY, BUSY], actuator=actuator)
    actuator.failure = RuntimeError("no place for a worker")
    decisions = steps(loop, clock, 2.0)
    assert [d.replicas.num_decode for d in decisions] == [1]       # the step up's interval failed
    assert loop.last_decision.replicas == ReplicaCounts.of_pools(1, 3)
    assert [str(e) for e in reporter.failures] == ["no place for a worker"]
    assert len(reporter.reported) == 1                    # the failed interval reported no decision
    assert len(loop.history) == 2                         # but its sample was read and kept
    actuator.failure = None
    clock[0] = 3.0
    again = run(loop.step())                              # the counts are read afresh: still 1P+1D
    assert again.current == ReplicaCounts.of_pools(1, 1) and actuator.applied == [ReplicaCounts.of_pools(1, 3)]


def test_a_failing_baseline_is_reported_and_the_intervals_follow():
    class Refusing(FakeActuator):
        async def read_replicas(self):
            raise PermissionError("forbidden")

    loop, clock, _, _, reporter, _, _ = make([QUIET] * 3, actuator=Refusing())
    assert run(loop.step()) is None
    assert [type(e) for e in reporter.failures] == [PermissionError] and loop.next_due == 1.0


def test_the_history_keeps_the_planners_span_and_a_few_more():
    loop, clock, _, _, _, _, _ = make([QUIET] * 80, window_s=10.0)
    assert history_length(loop.planner.config, 1.0) == 10 + 4 == loop.history.maxlen
    steps(loop, clock, 80.0)
    assert len(loop.history) == 14 and loop.history[-1].timestamp == 80.0


def test_reconfigure_keeps_the_history_and_brings_the_next_interval_forward():
    loop, clock, _, _, _, _, _ = make([QUIET] * 5)
    steps(loop, clock, 2.0)                                # next due at 3
    history = list(loop.history)
    clock[0] = 2.5
    slower = planner(decode=PoolBounds(1, 5))
    loop.reconfigure(slower, 10.0)                         # not later than it was
    assert loop.planner is slower and list(loop.history) == history and loop.next_due == 3.0
    assert loop.history.maxlen == history_length(slower.config, 10.0) == 10
    loop.reconfigure(slower, 0.25)                         # a shorter interval comes sooner
    assert loop.next_due == 2.75 and loop.history.maxlen == 244 and list(loop.history) == history


def test_a_worker_ready_after_its_start_refines_the_profiles_startup():
    loop = make([])[0]
    loop.refine_startup(10.0)
    assert 0.0 < loop.planner.profile.startup_s < 10.0


def test_the_package_imports_only_the_planner_base_modules_and_the_standard_library():
    allowed = ("splitserve.services.autoscaling", "splitserve.services.planner", "splitserve.errors",
               "splitserve.logs")
    for path in Path(autoscaling.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                top = name.split(".")[0]
                assert name.startswith(allowed) or (top != "splitserve" and top in sys.stdlib_module_names), \
                    f"{path.name} imports {name}"
