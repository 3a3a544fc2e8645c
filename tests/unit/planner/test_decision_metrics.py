"""Each planner decision as Prometheus metrics: the counts, the binding constraint (only the
latest per pool), the predicted and observed load."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from splitserve.services.planner import Planner, PlannerMode, ReplicaCounts
from splitserve.services.planner.decision_metrics import DecisionMetrics

from .conftest import make_config, make_profile, replay, steady


def test_a_decision_becomes_counts_a_binding_and_load():
    planner = Planner(make_config(mode=PlannerMode.DISAGGREGATED), make_profile())
    decisions = replay(planner, steady(60, 4.0, 2000, 50), ReplicaCounts.of_pools(1, 1))
    registry = CollectorRegistry()
    metrics = DecisionMetrics(registry)
    for d in decisions:
        metrics.record("demo", d)
    last = decisions[-1]
    value = registry.get_sample_value
    assert value("splitserve_planner_decisions_total", {"deployment": "demo", "changed": "false"}) \
        + (value("splitserve_planner_decisions_total", {"deployment": "demo", "changed": "true"}) or 0) == len(decisions)
    for pool in last.pools:
        assert value("splitserve_planner_replicas", {"deployment": "demo", "pool": pool.pool}) == pool.chosen
        bindings = [s for m in registry.collect() if m.name == "splitserve_planner_binding" for s in m.samples
                    if s.labels["pool"] == pool.pool]
        assert [s.labels["binding"] for s in bindings] == [pool.binding.value]
    assert value("splitserve_planner_load", {"deployment": "demo", "kind": "predicted",
                                             "quantity": "arrival_rate"}) == last.load.arrival_rate
