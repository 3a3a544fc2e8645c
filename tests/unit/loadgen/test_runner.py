"""The runner's bookkeeping against an in-memory server (httpx.MockTransport):
request budgets hold under bursts, turns run in order with earlier answers,
a failed turn ends its conversation, finite workloads end the run."""

from __future__ import annotations

import json

import httpx
import pytest

from splitserve.errors import SplitserveError
from splitserve.loadgen.arrivals import Concurrency, Poisson, TraceSchedule
from splitserve.loadgen.client import Target
from splitserve.loadgen.runner import Limits, run_workload
from splitserve.loadgen.workloads import Conversation, Turn, Workload

from .conftest import chat_chunk, sse, usage_chunk


def answering(log: list, fail_on: str | None = None):
    def handler(request: httpx.Request):
        if request.method == "GET":              # the runner's warm-up of /v1/models
            return httpx.Response(200, json={"object": "list", "data": []})
        body = json.loads(request.content)
        log.append(body)
        if fail_on is not None and fail_on in body["prompt"]:
            return httpx.Response(500, json={"error": {"message": "boom"}})
        text = f"<{len(log)}>"
        stream = sse(chat_chunk(text)) + sse(usage_chunk(3, 1)) + sse("[DONE]")
        return httpx.Response(200, content=stream)
    return handler


def workload(num_convs: int, turns: int = 1, cyclic: bool = True, arrivals=None) -> Workload:
    convs = [Conversation(f"c{i}", [Turn(f"c{i}t{k}", 1, 1) for k in range(turns)],
                          arrival_s=None if arrivals is None else arrivals[i]) for i in range(num_convs)]
    return Workload("test", convs, cyclic=cyclic)


TARGET = Target("http://127.0.0.1:9", "m")


@pytest.mark.parametrize("arrivals", [Poisson(1e6), Concurrency(3)])
def test_request_budget_holds(fake_vocab, arrivals):
    log = []
    records = run_workload(TARGET, fake_vocab, workload(4), arrivals, Limits(max_requests=10),
                           transport=httpx.MockTransport(answering(log)))
    assert len(records) == len(log) == 10
    assert [r.request_index for r in records] == list(range(10))
    assert all(r.ok and r.output_tokens == 1 for r in records)


def test_turns_run_in_order_with_earlier_answers(fake_vocab):
    log = []
    records = run_workload(TARGET, fake_vocab, workload(2, turns=3), Concurrency(1), Limits(max_requests=5),
                           transport=httpx.MockTransport(answering(log)))
    assert [(r.conversation_id, r.turn) for r in records] == [("c0", 0), ("c0", 1), ("c0", 2), ("c1", 0), ("c1", 1)]
    assert log[2]["prompt"] == "c0t0 <1> c0t1 <2> c0t2"
    assert log[3]["prompt"] == "c1t0"


def test_a_failed_turn_ends_its_conversation(fake_vocab):
    log = []
    records = run_workload(TARGET, fake_vocab, workload(2, turns=3, cyclic=False), Concurrency(1),
                           Limits(max_requests=100), transport=httpx.MockTransport(answering(log, fail_on="c0t1")))
    assert [(r.conversation_id, r.turn, r.error_kind) for r in records] == [
        ("c0", 0, None), ("c0", 1, "http_500"), ("c1", 0, None), ("c1", 1, None), ("c1", 2, None)]


def test_a_finite_workload_ends_the_run(fake_vocab):
    log = []
    records = run_workload(TARGET, fake_vocab, workload(3, cyclic=False, arrivals=[0.0, 0.0, 0.01]),
                           TraceSchedule(), Limits(max_requests=100), transport=httpx.MockTransport(answering(log)))
    assert len(records) == 3 and all(r.ok for r in records)
    assert [r.scheduled_s for r in records] == [0.0, 0.0, 0.01]
    assert all(r.start_s >= r.scheduled_s for r in records)


def test_limits_must_bound_the_run():
    with pytest.raises(SplitserveError, match="bound"):
        Limits()
    with pytest.raises(SplitserveError):
        Limits(max_requests=0)
    assert Limits(duration_s=5, request_timeout_s=7).drain == 7
