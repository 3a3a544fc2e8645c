"""The frontend's flow-control glue: headers → FlowRequest, priority bands, the room over the
worker pool, the 429 (body and headers) on the HTTP and gRPC sides, its count in the guard.

The controller itself is tested in tests/unit/flow_control; here it runs over a real
WorkerPool whose one worker is a small gRPC server on 127.0.0.1 (Health and Describe), so
the room follows the pool as it does in the frontend. Nothing sleeps: each step waits for
the condition it causes. Real frontend and worker processes: tests/integration/serving/
test_flow_control.py.
"""

from __future__ import annotations

import asyncio
import math

import grpc
import orjson
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc
from splitserve.services.flow_control import BandConfig, FlowRequest, Shed, ShedCause, SizedCapacity
from splitserve.services.frontend.errors import APIError
from splitserve.services.frontend.flow_admission import (FlowControlSettings, FrontendFlowControl, WorkerSlots,
                                                          shed_error)
from splitserve.services.frontend.flow_headers import DEFAULT_FLOW, check_priority, flow_request
from splitserve.services.frontend.guard import KEY_ID_SCOPE, GuardMiddleware
from splitserve.services.frontend.http.generation import Response
from splitserve.services.frontend.workers.pool import WorkerAddress, WorkerPool
from splitserve.testing.waiting import async_wait_until

from .conftest import counted_guard

TIMEOUT_S = 10.0


# -- headers → FlowRequest ------------------------------------------------------------------

def test_the_flow_is_the_fairness_header_else_the_key_else_the_default():
    assert flow_request([(b"x-llm-d-inference-fairness-id", b"tenant-a")], 0, "key-1", "r1").flow_id == "tenant-a"
    assert flow_request([(b"X-Gateway-Inference-Fairness-Id", b"old")], 0, None, "r1").flow_id == "old"
    both = [(b"x-gateway-inference-fairness-id", b"old"), (b"x-llm-d-inference-fairness-id", b"new")]
    assert flow_request(both, 0, None, "r1").flow_id == "new"           # llm-d's name wins
    assert flow_request([(b"x-llm-d-inference-fairness-id", b"  ")], 0, "key-1", "r1").flow_id == "key-1"
    assert flow_request([], 0, None, "r1").flow_id == DEFAULT_FLOW
    # gRPC metadata: string pairs
    got = flow_request([("x-llm-d-inference-fairness-id", "g"), ("x-llm-d-slo-ttft-ms", "250")], 7, None, "r2")
    assert got == FlowRequest("g", 7, 0.25, "r2")


def test_the_ttft_deadline_comes_in_milliseconds_and_a_bad_one_is_a_400():
    assert flow_request([(b"x-llm-d-slo-ttft-ms", b"1500")], 0, None, "r").ttft_deadline_s == 1.5
    assert flow_request([(b"x-slo-ttft-ms", b"20.5")], 0, None, "r").ttft_deadline_s == pytest.approx(0.0205)
    assert flow_request([], 0, None, "r").ttft_deadline_s is None
    for bad in (b"0", b"-5", b"soon", b"nan", b"inf"):
        with pytest.raises(APIError) as info:
            flow_request([(b"x-llm-d-slo-ttft-ms", bad)], 0, None, "r")
        error = info.value
        assert error.status == 400 and error.code == "invalid_header" and "x-llm-d-slo-ttft-ms" in error.message
    with pytest.raises(APIError) as info:
        flow_request([(b"x-llm-d-inference-fairness-id", b"t" * 257)], 0, None, "r")
    assert info.value.status == 400 and "256" in info.value.message


def test_a_non_zero_priority_needs_flow_control_as_vllm_needs_its_priority_policy():
    check_priority(0, False)
    check_priority(-3, True)
    with pytest.raises(APIError) as info:
        check_priority(1, False)
    assert info.value.status == 400 and info.value.param == "priority"
    assert "priority scheduling is not enabled" in info.value.message and "--flow-control" in info.value.message


# -- settings -----------------------------------------------------------------------------

def test_every_priority_has_a_band_and_a_lower_value_never_a_later_one():
    settings = FlowControlSettings((BandConfig(10, 4, 1.0), BandConfig(0, 4, 1.0), BandConfig(-5, 4, 1.0)))
    assert [b.priority for b in settings.bands] == [-5, 0, 10]
    assert [settings.band_of(p) for p in (-100, -5, -1, 0, 3, 9, 10, 99)] == [-5, -5, -5, 0, 0, 0, 10, 10]
    assert settings.config().default_priority == 0
    default = FlowControlSettings()                  # bands -1, 0, 1: the sign of the priority decides
    assert [default.band_of(p) for p in (-7, -1, 0, 1, 7)] == [-1, -1, 0, 1, 1]


def test_settings_that_cannot_work_name_the_flag():
    with pytest.raises(ValueError, match="--max-concurrency"):
        FlowControlSettings(max_concurrency=0)
    with pytest.raises(ValueError, match="given to two bands"):
        FlowControlSettings((BandConfig(0, 4, 1.0), BandConfig(0, 8, 1.0)))
    with pytest.raises(ValueError, match="--priority-band"):
        FlowControlSettings(())


# -- the 429 --------------------------------------------------------------------------------

def test_a_shed_request_is_a_429_with_the_dropped_reason_and_retry_after():
    error = shed_error(Shed(ShedCause.MAX_WAIT, 0, 3, "request shed (rejected-ttl-expired): it waited"))
    assert error.status == 429
    assert error.body() == {"error": {"message": "request shed (rejected-ttl-expired): it waited",
                                      "type": "rate_limit_error", "param": None, "code": "rejected-ttl-expired"}}
    assert error.headers == {"x-llm-d-request-dropped-reason": "rejected-ttl-expired", "retry-after": "3"}
    assert shed_error(Shed(ShedCause.QUEUE_FULL, 0, 1, "full")).headers["x-llm-d-request-dropped-reason"] == \
        "rejected-saturated"


def test_the_http_429_carries_its_headers_and_the_guard_counts_it_as_shed():
    """The generation route's Response sends the error's headers; the guard, which sees the
    response go out, counts it under reason "shed", not "invalid", and hands the app the key id."""
    guard, rejected = counted_guard(keys=("sk-unit",))
    seen: list[str | None] = []

    async def app(scope, receive, send):
        seen.append(scope.get(KEY_ID_SCOPE))
        await receive()
        error = shed_error(Shed(ShedCause.QUEUE_FULL, 0, 2, "full")) if scope["path"] == "/v1/shed" \
            else APIError(400, "bad")
        await Response(send, "cmpl-1").fail(error)

    async def call(path: str) -> list[dict]:
        sent = []
        messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive():
            return messages.pop(0) if messages else await asyncio.Event().wait()

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "client": ("10.0.0.1", 1),
                 "headers": [(b"authorization", b"Bearer sk-unit")]}
        await GuardMiddleware(app, guard)(scope, receive, send)
        return sent

    start, body = asyncio.run(call("/v1/shed"))
    headers = dict(start["headers"])
    assert start["status"] == 429 and headers[b"retry-after"] == b"2" and headers[b"x-request-id"] == b"cmpl-1"
    assert headers[b"x-llm-d-request-dropped-reason"] == b"rejected-saturated"
    assert orjson.loads(body["body"])["error"]["code"] == "rejected-saturated"
    assert asyncio.run(call("/v1/bad"))[0]["status"] == 400
    assert (rejected("http", "shed"), rejected("http", "invalid")) == (1, 1)
    assert seen[0] is not None and seen[0].startswith("key-") and seen[0] == seen[1]


# -- the room over a real pool -----------------------------------------------------------------

class DescribedWorker(worker_pb2_grpc.WorkerServicer):
    """Health and Describe of one decode-capable worker on 127.0.0.1 (no engine behind it)."""

    def __init__(self) -> None:
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    async def Describe(self, request, context):
        return worker_pb2.DescribeResponse(worker_id="w0", instance_id="i1", max_model_len=100, block_size=4)


def test_the_room_is_per_ready_worker_and_a_worker_turning_ready_dispatches_the_queue():
    async def go():
        worker = DescribedWorker()
        await worker.server.start()
        await worker.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        pool = WorkerPool.connect([WorkerAddress("both", worker.address)])
        registry = CollectorRegistry()
        settings = FlowControlSettings((BandConfig(0, 1, math.inf), BandConfig(5, 8, math.inf)), max_concurrency=2)
        flow = FrontendFlowControl(settings, pool, registry)
        pool.start()
        try:
            # No ready worker: no room, so a request waits; a second one of the same flow finds its
            # band (max-queue 1) full and is shed with the 429.
            first = asyncio.create_task(flow.admit(FlowRequest("a", 0)))
            await async_wait_until(lambda: flow.num_queued() == 1, timeout=TIMEOUT_S, what="the first queued")
            with pytest.raises(APIError) as info:
                await flow.admit(FlowRequest("a", -3))                  # below every band: band 0
            assert info.value.status == 429 and info.value.code == "rejected-saturated"
            low = asyncio.create_task(flow.admit(FlowRequest("b", 7)))  # band 5
            await async_wait_until(lambda: flow.num_queued() == 2, timeout=TIMEOUT_S, what="the low one queued")
            # The worker turns ready: room for 2, dispatched in band order.
            await worker.health.set("", health_pb2.HealthCheckResponse.SERVING)
            tickets = await asyncio.wait_for(asyncio.gather(first, low), TIMEOUT_S)
            assert [t.band for t in tickets] == [0, 5] and flow.slots.num_in_flight == 2
            third = asyncio.create_task(flow.admit(FlowRequest("c", 0)))
            await async_wait_until(lambda: flow.num_queued() == 1, timeout=TIMEOUT_S, what="the third queued")
            tickets[1].release()                                         # its unit goes to the third
            with await asyncio.wait_for(third, TIMEOUT_S):
                assert flow.slots.num_in_flight == 2
            tickets[0].release()
            assert flow.slots.num_in_flight == 0 and flow.num_queued() == 0
            sample = registry.get_sample_value
            assert sample("splitserve_flow_control_dispatched_total", {"band": "0"}) == 2
            assert sample("splitserve_flow_control_shed_total",
                          {"band": "0", "reason": "rejected-saturated", "cause": "queue_full"}) == 1
        finally:
            await pool.close()
            await worker.server.stop(None)

    asyncio.run(go())


def test_worker_slots_count_units_against_the_ready_workers():
    ready = [1]
    slots = WorkerSlots(3, lambda: ready[0])
    for _ in range(3):
        assert slots.has_room()
        slots.take()
    assert not slots.has_room()
    ready[0] = 2
    assert slots.has_room()
    ready[0] = 0                       # workers gone: the running ones keep their units
    assert not slots.has_room() and slots.units() == 0
    ready[0] = 1
    assert isinstance(slots, SizedCapacity) and slots.units() == 3
    slots.take(beyond_room=True)       # fair sharing's burst: past the room (the controller bounds it)
    assert slots.num_in_flight == 4 and not slots.has_room()
    for _ in range(4):
        slots.give_back()
    with pytest.raises(RuntimeError):
        slots.give_back()
