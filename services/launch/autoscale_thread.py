"""`serve --autoscale`: the shared autoscaling loop (services/autoscaling) over serve's own workers,
on a thread of `serve`.

Every HOUSEKEEPING_S the thread does the workers' housekeeping (local_scaling.LocalWorkers: a
started worker that turned SERVING, whose start-up time refines the planner's profile; a
drained worker gone; a mode switch's next step), then the loop's `step()`: at start the
baseline, then every `--autoscale-interval` seconds one interval (services/autoscaling/loop.py):

1. the counts asked for (the workers starting and serving, not those draining; after a
   decision, its counts) and the interval's sample from the frontends' /metrics and the
   workers' Stats (local_metrics.py);
2. `Planner.decide(history, sample)`, then the profile refined with what the interval measured;
3. the decision as one console line ("autoscale: planner: 1A -> 2A aggregated ..."); with
   `--autoscale-metrics-port` also the `splitserve_planner_*` metrics labelled "serve"
   (planner/decision_metrics.py); `loop.last_decision` holds the latest;
4. a change applied to the workers: started, drained, moved between pools (local_scaling.py).

The loop is a coroutine; this thread runs it on an event loop of its own (`asyncio.Runner`),
on which the seams' blocking calls (a scrape, a process start) hold up nothing else. An
interval or a housekeeping that raises is one console line with its traceback, and the
deployment keeps its workers.
"""

from __future__ import annotations

import asyncio
import threading
import traceback
from collections.abc import Callable

from splitserve.services.autoscaling import DecisionLog, MetricsRecorder, SampleSource, ScalingLoop
from splitserve.services.launch.local_metrics import LocalMetricsSource
from splitserve.services.launch.local_scaling import LocalWorkers, ScaledWorker, WorkerLauncher
from splitserve.services.launch.topology import AutoscaleSettings
from splitserve.services.launch.supervisor import Supervisor
from splitserve.services.planner import (CapacityProfile, Decision, Planner, PlannerConfig, PlannerMode, PoolBounds,
                                         SloTargets)
from splitserve.tls import PLAINTEXT, TlsConfig

HOUSEKEEPING_S = 0.5
METRICS_LABEL = "serve"


def planner_config(settings: AutoscaleSettings, aggregated: bool) -> PlannerConfig:
    """The planner's config for local workers: 1..max workers a pool; the mode serve runs in
    (`--autoscale-mode fixed`, or one place only) or either (`auto`)."""
    m = settings.max_workers
    if settings.may_switch_modes:
        mode = PlannerMode.AUTO
    else:
        mode = PlannerMode.AGGREGATED if aggregated else PlannerMode.DISAGGREGATED
    return PlannerConfig(
        SloTargets(settings.ttft_p90_s, settings.itl_p90_s),
        prefill=PoolBounds(1, max(1, m - 1)), decode=PoolBounds(1, max(1, m - 1)), aggregated=PoolBounds(1, m),
        max_workers=m, mode=mode, cooldown_s=settings.cooldown_s, window_s=max(60.0, 3 * settings.interval_s))


class LocalAutoscaler:
    """The thread (module header); also the loop's `DecisionReporter`: serve's console."""

    def __init__(self, actuator: LocalWorkers, source: SampleSource, say: Callable[[str], None],
                 settings: AutoscaleSettings, profile: CapacityProfile, metrics: MetricsRecorder | None = None):
        self.actuator = actuator
        self.say = say
        planner = Planner(planner_config(settings, actuator.aggregated), profile)
        self.loop = ScalingLoop(planner, settings.interval_s, source, actuator, self,
                                DecisionLog(say, "autoscale: ", METRICS_LABEL, metrics))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        with asyncio.Runner() as runner:
            while not self._stop.is_set():
                try:
                    self.housekeeping()
                    runner.run(self.loop.step())         # the baseline first, then each interval when due
                except Exception as exc:  # noqa: BLE001 - the autoscaler must not take serving down
                    self._say_error(exc)
                self._stop.wait(HOUSEKEEPING_S)

    def housekeeping(self, now: float | None = None) -> None:
        """The workers' housekeeping; a worker that turned SERVING refines the profile's start-up time."""
        for startup_s in self.actuator.housekeeping(now):
            self.loop.refine_startup(startup_s)

    # -- DecisionReporter ----------------------------------------------------------------
    async def report(self, decision: Decision) -> None:
        """Nothing beyond the loop's console line: serve has no object to record a decision on."""

    async def report_failure(self, exc: Exception) -> None:
        self._say_error(exc)

    def _say_error(self, exc: BaseException) -> None:
        self.say("autoscale: error (the deployment keeps its workers):\n"
                 + "".join(traceback.format_exception(exc)).rstrip())


def local_autoscaler(sup: Supervisor, say: Callable[[str], None], settings: AutoscaleSettings, aggregated: bool,
                     profile: CapacityProfile, launcher: WorkerLauncher, workers: list[ScaledWorker],
                     frontend_urls: list[str], tls: TlsConfig = PLAINTEXT,
                     metrics: MetricsRecorder | None = None) -> LocalAutoscaler:
    """serve's autoscaler over `workers` (started by serve, each in its place), its samples read
    from the frontends at `frontend_urls` (base URLs) and the workers SERVING."""
    source: LocalMetricsSource | None = None
    actuator = LocalWorkers(sup, say, settings, aggregated, launcher, workers, tls,
                            last_reading=lambda: source.last_reading if source is not None else None)
    source = LocalMetricsSource(frontend_urls, actuator.serving, say, tls)
    return LocalAutoscaler(actuator, source, say, settings, profile, metrics)
