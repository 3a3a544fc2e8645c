"""What a deployment supplies to the autoscaling loop (loop.py), one protocol per part.

The loop awaits every seam: the operator's are real coroutines on its event loop (apiserver
calls, the frontend pods' scrape); serve runs the loop on an event loop of its own in the
autoscaler's thread, where its seams do their blocking work (a /metrics GET, a Stats call, a
process start) inline: nothing else runs on that event loop.
"""

from __future__ import annotations

from typing import Protocol

from splitserve.services.planner import Decision, MetricsSample, ReplicaCounts


class SampleSource(Protocol):
    """The planner's input, one sample per interval."""

    async def sample(self, replicas: ReplicaCounts) -> MetricsSample | None:
        """The interval since the previous call as a `MetricsSample` whose `replicas` are
        `replicas` (the counts asked for, `ScaleActuator.read_replicas`). None: no sample this
        time (the first reading only sets a baseline; a frontend did not answer; one restarted,
        a new baseline). Samples come in increasing timestamp order; the loop drops one that
        does not."""


class ScaleActuator(Protocol):
    """The counts a deployment was asked for, and how they change."""

    async def read_replicas(self) -> ReplicaCounts | None:
        """What has been asked for: starting workers included, draining ones not (the planner
        reads its cool-down from these counts, so they must not dip while a worker starts).
        None: nothing to scale yet (the interval is skipped; the operator's ServingPools do not
        exist yet)."""

    async def apply(self, decision: Decision) -> None:
        """Take the deployment to `decision.replicas` (called only when `decision.changed`):
        grow at once, shrink by draining, switch modes as the deployment does it. An outcome the
        deployment can say itself (a patch someone else's scale overtook) it says and returns;
        what it raises is the interval's failure (`DecisionReporter.report_failure`)."""


class DecisionReporter(Protocol):
    """What a deployment tells beyond the loop's log line and metrics."""

    async def report(self, decision: Decision) -> None:
        """After the interval's decision and its `apply` (the operator: an Event and
        status.autoscaling)."""

    async def report_failure(self, exc: Exception) -> None:
        """An interval raised `exc` (the baseline's included); the loop goes on with the next
        one and the deployment keeps what it runs."""


class MetricsRecorder(Protocol):
    """planner/decision_metrics.DecisionMetrics, without importing prometheus_client here."""

    def record(self, deployment: str, decision: Decision) -> None:
        """Set the decision's gauges and counters under the label `deployment`."""
