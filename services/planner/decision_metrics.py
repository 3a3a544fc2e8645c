"""The planner's decisions as Prometheus metrics (issue 22: each decision in a log line, an Event
and a metric). Not imported by the package: the planner itself stays free of I/O libraries.

- splitserve_planner_decisions_total{deployment, changed}: decisions made;
- splitserve_planner_replicas{deployment, pool}: the count chosen; ..._needed: what the model
  needed before bounds, cool-down and hysteresis;
- splitserve_planner_binding{deployment, pool, binding}: 1 for the constraint that set the pool's
  count in the last decision (the pool's other bindings are removed);
- splitserve_planner_load{deployment, kind, quantity}: the predicted load (arrival_rate,
  prefill_tokens_per_s, decode_tokens_per_s) and the observed inputs (arrival_rate, ttft_p90_s,
  itl_p90_s, queue_depth).
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from splitserve.services.planner.decision import Binding, Decision


class DecisionMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY):
        self.decisions = Counter("splitserve_planner_decisions", "SLO planner decisions",
                                 ["deployment", "changed"], registry=registry)
        self.replicas = Gauge("splitserve_planner_replicas", "Workers per pool the planner chose",
                              ["deployment", "pool"], registry=registry)
        self.needed = Gauge("splitserve_planner_needed", "Workers per pool the planner's model needed",
                            ["deployment", "pool"], registry=registry)
        self.binding = Gauge("splitserve_planner_binding", "1: the constraint that set the pool's count",
                             ["deployment", "pool", "binding"], registry=registry)
        self.load = Gauge("splitserve_planner_load", "The planner's predicted load and observed inputs",
                          ["deployment", "kind", "quantity"], registry=registry)

    def record(self, deployment: str, decision: Decision) -> None:
        self.decisions.labels(deployment, str(decision.changed).lower()).inc()
        for p in decision.pools:
            self.replicas.labels(deployment, p.pool).set(p.chosen)
            self.needed.labels(deployment, p.pool).set(p.needed)
            for b in Binding:
                if b is not p.binding:
                    try:
                        self.binding.remove(deployment, p.pool, b.value)
                    except KeyError:
                        pass
            self.binding.labels(deployment, p.pool, p.binding.value).set(1)
        load, seen = decision.load, decision.inputs
        for quantity, value in (("arrival_rate", load.arrival_rate), ("prefill_tokens_per_s", load.prefill_tokens_per_s),
                                ("decode_tokens_per_s", load.decode_tokens_per_s)):
            self.load.labels(deployment, "predicted", quantity).set(value)
        for quantity, value in (("arrival_rate", seen.arrival_rate), ("ttft_p90_s", seen.ttft_p90_s),
                                ("itl_p90_s", seen.itl_p90_s), ("queue_depth", seen.frontend_queue_depth)):
            if value is not None:
                self.load.labels(deployment, "observed", quantity).set(value)
