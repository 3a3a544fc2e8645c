"""The SLO planner (issue 22): how many prefill and decode workers to run, and whether to split them.

Pure decision logic: no Kubernetes, no network, no torch, no clock. It only decides; the
`serve --autoscale` loop and the operator apply its counts (start a worker, drain one,
patch a ServingPool's scale subresource), as the router only decides where a request goes.

One job per module:

- `samples.py`   what it reads: `MetricsSample` per interval (arrivals, length mix, observed
                 TTFT/ITL p90, queue depth, per-worker `WorkerLoadSample`, `ReplicaCounts`);
- `profile.py`   `CapacityProfile`: one worker's prefill tokens/s by prompt length, decode
                 tokens/s by batch size, start-up time; from a profile run, refined online;
- `predictor.py` `LoadPredictor`: the load of the next interval (`PredictedLoad`);
- `sizing.py`    the queueing model: the workers a load needs per pool (`SizingModel`);
- `config.py`    `PlannerConfig`: `SloTargets`, `PoolBounds`, mode, dead band, cool-down;
- `planner.py`   `Planner.decide`: hysteresis, cool-down, mode, bounds; `Planner.learned`;
- `mode_misses.py` what the modes served: a mode that missed the SLO with all its workers;
- `decision.py`  `Decision`: the counts and why (`explain()` log line, `fields()` for metrics);
- `readings.py`  live inputs: `SampleBuilder` turns two readings of the frontends' /metrics and
                 the workers' Stats into a `MetricsSample`; `choose_to_drain` picks a worker.

Use, once per interval (say every 10 s):

    planner = Planner(PlannerConfig(SloTargets(ttft_p90_s=1.0, itl_p90_s=0.05), max_workers=8),
                      CapacityProfile.from_measurements(prefill_runs, decode_runs, startup_s=40.0))
    history: deque[MetricsSample] = deque(maxlen=64)       # >= cooldown_s of samples
    ...
    sample = MetricsSample(timestamp=now, interval_s=10.0, num_arrivals=..., ..., replicas=asked_for)
    decision = planner.decide(history, sample)
    log.info("%s", decision.explain())
    if decision.changed:
        apply(decision.replicas)          # start workers at once; drain before removing
    planner = planner.learned(history, sample)
    history.append(sample)

`sample.replicas` must be the counts asked for (the last decision applied, starting workers
included), not only the ready ones: the planner reads its cool-down from them.
"""

from splitserve.services.planner.config import PlannerConfig, PlannerMode, PoolBounds, SloTargets
from splitserve.services.planner.decision import Binding, Decision, PoolDecision
from splitserve.services.planner.planner import Planner
from splitserve.services.planner.predictor import LoadPredictor, PredictedLoad
from splitserve.services.planner.profile import (CapacityKind, CapacityObservation, CapacityProfile,
                                                 DecodeMeasurement, PrefillMeasurement, ThroughputCurve,
                                                 observations_from_sample)
from splitserve.services.planner.samples import MetricsSample, ReplicaCounts, WorkerLoadSample
from splitserve.services.planner.sizing import PoolNeed, SizingModel

__all__ = [
    "Binding", "CapacityKind", "CapacityObservation", "CapacityProfile", "Decision", "DecodeMeasurement",
    "LoadPredictor", "MetricsSample", "Planner", "PlannerConfig", "PlannerMode", "PoolBounds", "PoolDecision",
    "PoolNeed", "PredictedLoad", "PrefillMeasurement", "ReplicaCounts", "SizingModel", "SloTargets",
    "ThroughputCurve", "WorkerLoadSample", "observations_from_sample",
]
