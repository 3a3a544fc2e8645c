"""The SLO autoscaling loop: the planner's decisions applied to a deployment, one interval at a time.

`splitserve serve --autoscale` (services/launch) and the operator's `spec.autoscaling`
(operator/controller) run the same loop; each supplies only what differs between them:

- `seams.py` the parts a deployment supplies: `SampleSource` (a planner `MetricsSample` per
             interval: serve scrapes its own frontends and workers, the operator the frontend
             pods and worker groups), `ScaleActuator` (the counts asked for and how they change:
             local processes started and drained, or ServingPools' scale subresources patched),
             `DecisionReporter` (what the deployment tells of a decision and of a failed
             interval: serve's console, the operator's Events and status.autoscaling);
- `loop.py`  `ScalingLoop`: the baseline, then every interval: read the counts asked for and a
             sample, `Planner.decide`, `Planner.learned`, the log line and metrics, apply a
             change, report; cool-downs and mode switches are the planner's (it reads them from
             the samples' counts), their mechanics the actuator's.

Why a package of its own, not part of services/planner: the planner is pure (no clock, no
asyncio, no I/O), so a recorded series of samples replays to the same decisions; this loop
has a clock, awaits its seams and keeps state between intervals. It imports only the planner,
splitserve's base modules and the standard library, so the operator may import it as it
imports the planner, and nothing of services/launch, worker, engine or frontend comes with it.
"""

from splitserve.services.autoscaling.loop import DecisionLog, ScalingLoop, history_length
from splitserve.services.autoscaling.seams import (DecisionReporter, MetricsRecorder, SampleSource,
                                                   ScaleActuator)

__all__ = ["DecisionLog", "DecisionReporter", "MetricsRecorder", "SampleSource", "ScaleActuator", "ScalingLoop",
           "history_length"]
