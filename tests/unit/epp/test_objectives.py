"""InferenceObjectives: the header, the priority it names, and how flow control gets it
(services/epp/objectives.py, services/epp/server.py). The watch runs against a real apiserver in
tests/k8s/test_chart.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from splitserve.errors import SplitserveError
from splitserve.services.epp.metrics import EppMetrics
from splitserve.services.epp.objectives import ObjectiveBook, objective_entry, parse_objective_flag
from splitserve.services.epp.server import _admission
from splitserve.testing.metrics import sample_sum


def test_objective_flags():
    assert parse_objective_flag("critical=10") == ("critical", 10)
    assert parse_objective_flag(" batch =-1") == ("batch", -1)
    for bad in ("critical", "=3", "x=high", "x=1.5"):
        with pytest.raises(SplitserveError, match="--objective takes NAME=PRIORITY"):
            parse_objective_flag(bad)


def _objective(name, pool, priority=None):
    spec = {"poolRef": {"group": "inference.networking.k8s.io", "name": pool}}
    if priority is not None:
        spec["priority"] = priority
    return {"metadata": {"name": name}, "spec": spec}


def test_only_the_pools_objectives_count_and_unset_priority_is_zero():
    assert objective_entry(_objective("a", "llm", 5), "llm") == ("a", 5)
    assert objective_entry(_objective("b", "llm"), "llm") == ("b", 0)
    assert objective_entry(_objective("c", "other", 5), "llm") is None
    assert objective_entry({"metadata": {"name": "d"}}, "llm") is None


def test_the_book_names_priorities_in_vllms_direction_and_the_cluster_wins():
    book = ObjectiveBook({"critical": 10, "batch": -1})
    assert book.named({"x-gateway-inference-objective": " critical "}) == "critical"
    assert book.named({"x-llm-d-inference-objective": "batch"}) == "batch"
    assert book.named({"x-gateway-inference-objective": "", "x-llm-d-inference-objective": "batch"}) == "batch"
    assert book.named({}) == ""
    assert book.priority_of("critical") == -10 and book.priority_of("batch") == 1
    assert book.priority_of("nobody") is None
    book.replace_watched({"critical": 2})
    assert book.priority_of("critical") == -2
    book.set_watched("critical", None)
    assert book.priority_of("critical") == -10


class RecordingFlowControl:
    def __init__(self):
        self.requests = []

    async def admit(self, request):
        self.requests.append(request)
        return "ticket"


def test_admission_orders_by_the_objective_over_the_bodys_priority_and_counts_unknown_names():
    flow_control = RecordingFlowControl()
    registry = CollectorRegistry()
    metrics = EppMetrics(registry)
    admit = _admission(SimpleNamespace(flow_control=flow_control), ObjectiveBook({"critical": 10}), metrics)

    async def run():
        assert await admit({"x-gateway-inference-objective": "critical"}, 5) == "ticket"
        await admit({"x-gateway-inference-objective": "unknown", "x-llm-d-inference-fairness-id": "t"}, 5)
        await admit({}, -1)

    asyncio.run(run())
    assert [(r.priority, r.flow_id) for r in flow_control.requests] == [(-10, "default"), (5, "t"), (-1, "default")]
    text = generate_latest(registry).decode()
    assert sample_sum(text, "splitserve_epp_objective_requests_total", known="true") == 1
    assert sample_sum(text, "splitserve_epp_objective_requests_total", known="false") == 1


def test_without_flow_control_there_is_no_admission():
    assert _admission(SimpleNamespace(flow_control=None), ObjectiveBook({"a": 1}),
                      EppMetrics(CollectorRegistry())) is None

