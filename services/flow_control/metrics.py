"""Flow control's Prometheus metrics, on a registry the caller passes in.

- `splitserve_flow_control_queued_requests{band}`: requests waiting in each band (gauge);
- `splitserve_flow_control_flow_queued_requests{band, flow}`: requests waiting per flow, for the
  busiest `num_flow_series` flows of each band only (gauge);
- `splitserve_flow_control_wait_seconds{band}`: time from arrival to dispatch (histogram; the fast
  path observes 0, so its count is the dispatch count);
- `splitserve_flow_control_dispatched_total{band}`: requests dispatched (counter);
- `splitserve_flow_control_burst_dispatched_total{band}`: of those, the ones dispatched beyond
  the room, a steady flow's burst while a flooding flow holds units (fair_share.py) (counter);
- `splitserve_flow_control_shed_total{band, reason, cause}`: requests shed, by llm-d's dropped
  reason and by flow control's own cause (shedding.py) (counter).

`band` is the band's priority value. The two gauges are read from the controller's queues at
scrape time (`watch`), so the request path keeps nothing in step for them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from splitserve.services.flow_control.shedding import ShedCause

DEFAULT_NUM_FLOW_SERIES = 10
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

QueueLengths = Callable[[], Mapping[int, Mapping[str, int]]]     # band → flow → requests queued

QUEUED = "splitserve_flow_control_queued_requests"
FLOW_QUEUED = "splitserve_flow_control_flow_queued_requests"


class FlowControlMetrics:
    """The metrics one FlowController reports (it calls `watch`, `count_dispatch`, `count_shed`)."""

    def __init__(self, registry: CollectorRegistry, num_flow_series: int = DEFAULT_NUM_FLOW_SERIES) -> None:
        if num_flow_series < 0:
            raise ValueError(f"num_flow_series must be >= 0, not {num_flow_series!r}")
        self.waits = Histogram("splitserve_flow_control_wait_seconds",
                               "Time from a request's arrival at flow control to its dispatch, by band",
                               ["band"], buckets=WAIT_BUCKETS, registry=registry)
        self.dispatched = Counter("splitserve_flow_control_dispatched", "Requests flow control dispatched, by band",
                                  ["band"], registry=registry)
        self.burst_dispatched = Counter("splitserve_flow_control_burst_dispatched",
                                        "Requests flow control dispatched beyond the room (a steady flow's burst "
                                        "while a flooding flow holds units), by band", ["band"], registry=registry)
        self.shed = Counter("splitserve_flow_control_shed",
                            "Requests flow control shed (429), by band, llm-d dropped reason and cause",
                            ["band", "reason", "cause"], registry=registry)
        self._queues = _QueueLengthCollector(num_flow_series)
        registry.register(self._queues)

    def watch(self, queue_lengths: QueueLengths) -> None:
        """Read the queue gauges from `queue_lengths()` at each scrape."""
        self._queues.source = queue_lengths

    def count_dispatch(self, band: int, waited_s: float, beyond_room: bool = False) -> None:
        label = str(band)
        self.dispatched.labels(band=label).inc()
        self.waits.labels(band=label).observe(waited_s)
        if beyond_room:
            self.burst_dispatched.labels(band=label).inc()

    def count_shed(self, band: int, cause: ShedCause) -> None:
        self.shed.labels(band=str(band), reason=cause.dropped_reason, cause=cause.value).inc()


class _QueueLengthCollector:
    def __init__(self, num_flow_series: int) -> None:
        self.num_flow_series = num_flow_series
        self.source: QueueLengths | None = None

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(QUEUED, "", labels=["band"])
        yield GaugeMetricFamily(FLOW_QUEUED, "", labels=["band", "flow"])

    def collect(self) -> Iterator[Metric]:
        queued = GaugeMetricFamily(QUEUED, "Requests waiting in flow control, by band", labels=["band"])
        per_flow = GaugeMetricFamily(FLOW_QUEUED, "Requests waiting in flow control, for the busiest flows of "
                                     "each band", labels=["band", "flow"])
        for band, flows in (self.source() if self.source is not None else {}).items():
            queued.add_metric([str(band)], sum(flows.values()))
            # Flow ids come from clients (a header, an API key), so a series per flow would let them
            # grow the registry without bound; the busiest few per band are what an operator needs.
            busiest = heapq.nsmallest(self.num_flow_series, flows.items(), key=lambda item: (-item[1], item[0]))
            for flow_id, num_queued in busiest:
                per_flow.add_metric([str(band), flow_id], num_queued)
        yield queued
        yield per_flow
