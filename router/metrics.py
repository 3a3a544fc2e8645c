"""Routing decisions as Prometheus metrics (DESIGN section 8), in a caller's registry.

- splitserve_router_decisions_total{leg, policy, winner, runner_up}: a counter;
- splitserve_router_last_decision{leg, policy, winner, winner_terms, runner_up,
  runner_up_terms}: 1 for the newest decision of each leg only (one series per
  leg, formatted when scraped) — the "why" of the last choice, readable from
  /metrics;
- splitserve_router_index_blocks{worker}: blocks the index holds per worker;
- splitserve_router_index_tier_blocks{worker, tier}: the blocks it credits each worker in its host and
  disk tiers and in the shared store (tier "store": the store's blocks, for an attached worker).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from splitserve.router.policies import Decision


class LastDecisions(Collector):
    """splitserve_router_last_decision: the newest decision of each leg, its labels formatted at
    scrape time (a request only stores the decision; its cost terms change every time)."""

    def __init__(self) -> None:
        self.latest: dict[str, Decision] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("splitserve_router_last_decision",
                                   "The newest routing decision of each leg and why (labels)",
                                   labels=["leg", "policy", "winner", "winner_terms", "runner_up",
                                           "runner_up_terms"])
        for leg, d in sorted(self.latest.items()):
            runner = d.runner_up
            family.add_metric([leg, d.policy, d.winner.worker_id, d.winner.terms(),
                               runner.worker_id if runner else "", runner.terms() if runner else ""], 1)
        yield family


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        self.decisions = Counter("splitserve_router_decisions", "Routing decisions",
                                 ["leg", "policy", "winner", "runner_up"], registry=r)
        self.last = LastDecisions()
        r.register(self.last)
        self.index_blocks = Gauge("splitserve_router_index_blocks", "Cached blocks in the router's index",
                                  ["worker"], registry=r)
        self.index_tier_blocks = Gauge("splitserve_router_index_tier_blocks",
                                       "Blocks the router's index credits a worker below its device pool",
                                       ["worker", "tier"], registry=r)

    def record(self, leg: str, d: Decision) -> None:
        self.decisions.labels(leg, d.policy, d.winner.worker_id, d.runner_up.worker_id if d.runner_up else "").inc()
        self.last.latest[leg] = d
