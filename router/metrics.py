"""Routing decisions as Prometheus metrics (DESIGN section 8), in a caller's registry.

- splitserve_router_decisions_total{leg, policy, winner, runner_up}: a counter;
- splitserve_router_last_decision{leg, policy, winner, winner_terms, runner_up,
  runner_up_terms}: 1 for the newest decision of each leg only (older series are
  removed, so cardinality stays one series per leg) — the "why" of the last
  choice, readable from /metrics;
- splitserve_router_index_blocks{worker}: blocks the index holds per worker.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from .policies import Decision


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        self.decisions = Counter("splitserve_router_decisions", "Routing decisions",
                                 ["leg", "policy", "winner", "runner_up"], registry=r)
        self.last = Gauge("splitserve_router_last_decision",
                          "The newest routing decision of each leg and why (labels)",
                          ["leg", "policy", "winner", "winner_terms", "runner_up", "runner_up_terms"], registry=r)
        self.index_blocks = Gauge("splitserve_router_index_blocks", "Cached blocks in the router's index",
                                  ["worker"], registry=r)
        self._last_labels: dict[str, tuple] = {}

    def record(self, leg: str, d: Decision) -> None:
        runner = d.runner_up.worker_id if d.runner_up else ""
        self.decisions.labels(leg, d.policy, d.winner.worker_id, runner).inc()
        labels = (leg, d.policy, d.winner.worker_id, d.winner.terms(), runner,
                  d.runner_up.terms() if d.runner_up else "")
        old = self._last_labels.get(leg)
        if old is not None and old != labels:
            self.last.remove(*old)
        self.last.labels(*labels).set(1)
        self._last_labels[leg] = labels
