"""One request's ext_proc stream (services/epp/exchange.py), with a recording picker in place of
the router (the real one runs in tests/integration/gateway)."""

from __future__ import annotations

import asyncio
import json

from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from splitserve.proto.v1 import ext_proc_pb2

from splitserve.services.epp.exchange import Exchange
from splitserve.services.epp.health import ProbeHealth
from splitserve.services.epp.metrics import EppMetrics
from splitserve.services.epp.picker import Parsed, Pick
from splitserve.services.flow_control import Shed, ShedCause
from splitserve.services.frontend.errors import APIError


class RecordingPicker:
    def __init__(self, refuse: APIError | None = None):
        self.refuse = refuse
        self.calls: list[tuple[str, bytes | None, frozenset | None]] = []
        self.credits: list[str] = []

    def parse(self, path, body) -> Parsed:
        self.calls.append((path, body))
        if self.refuse is not None:
            raise self.refuse
        return Parsed([1, 2, 3], priority=-1)

    def route(self, parsed, subset=None) -> Pick:
        self.routed = (parsed, subset)
        return Pick("r1", ["10.0.0.1:8000"], "10.0.0.9:50051", "w1")

    def credit_first_token(self, pick):
        self.credits.append("first")

    def credit_finished(self, pick):
        self.credits.append("finished")


def _exchange(picker, admission=None, max_body_bytes=1000) -> tuple[Exchange, EppMetrics]:
    metrics = EppMetrics(CollectorRegistry())
    return Exchange(picker, metrics, max_body_bytes, admission), metrics


def _headers(eos=False):
    return ext_proc_pb2.ProcessingRequest(request_headers=ext_proc_pb2.HttpHeaders(
        headers=ext_proc_pb2.HeaderMap(headers=[ext_proc_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
                                            ext_proc_pb2.HeaderValue(key="x-llm-d-inference-fairness-id",
                                                                 raw_value=b"tenant-a")]),
        end_of_stream=eos))


def _body(data, eos):
    return ext_proc_pb2.ProcessingRequest(request_body=ext_proc_pb2.HttpBody(body=data, end_of_stream=eos))


def _kinds(responses):
    return [r.WhichOneof("response") for r in responses]


def run(coro):
    return asyncio.run(coro)


def test_the_body_is_gathered_then_routed_and_echoed_then_the_response_credited():
    picker = RecordingPicker()
    ex, metrics = _exchange(picker)

    async def go():
        assert await ex.on(_headers()) == []
        assert await ex.on(_body(b'{"a":', False)) == []
        routed = await ex.on(_body(b"1}", True))
        assert _kinds(routed) == ["request_headers", "request_body"]
        assert picker.calls == [("/v1/completions", b'{"a":1}')] and picker.routed == (Parsed([1, 2, 3], priority=-1),
                                                                                       None)
        assert _kinds(await ex.on(ext_proc_pb2.ProcessingRequest(response_headers=ext_proc_pb2.HttpHeaders()))) \
            == ["response_headers"]
        for chunk, eos in ((b"", False), (b"data: 1\n\n", False), (b"data: 2\n\n", False), (b"", True)):
            out = await ex.on(ext_proc_pb2.ProcessingRequest(response_body=ext_proc_pb2.HttpBody(body=chunk,
                                                                                                  end_of_stream=eos)))
            assert out[0].response_body.response.body_mutation.streamed_response.body == chunk
        ex.close()                  # the stream ends: nothing is credited twice

    run(go())
    assert picker.credits == ["first", "finished"]
    assert metrics.requests.labels("routed")._value.get() == 1


def test_a_refusal_is_one_immediate_response_with_the_model_servers_body():
    picker = RecordingPicker(APIError(404, "the model 'x' does not exist", param="model", code="model_not_found"))
    ex, metrics = _exchange(picker)
    out = run(ex.on(_headers(eos=True)))
    assert _kinds(out) == ["immediate_response"] and ex.ended
    assert out[0].immediate_response.status.code == 404
    assert json.loads(out[0].immediate_response.body)["error"]["code"] == "model_not_found"
    assert metrics.requests.labels("refused")._value.get() == 1 and picker.credits == []


def test_an_oversized_body_is_413_before_it_is_parsed():
    picker = RecordingPicker()
    ex, _ = _exchange(picker, max_body_bytes=10)

    async def go():
        await ex.on(_headers())
        return await ex.on(_body(b"x" * 11, False))

    out = run(go())
    assert out[0].immediate_response.status.code == 413 and picker.calls == []


def test_a_shed_request_gets_429_with_the_reason_and_is_never_picked():
    picker = RecordingPicker()
    seen = []

    async def admission(headers, priority):
        seen.append((headers["x-llm-d-inference-fairness-id"], priority))
        raise Shed(ShedCause.QUEUE_FULL, 0, 3, "the queue of priority 0 is full")

    ex, metrics = _exchange(picker, admission)
    out = run(ex.on(_headers(eos=True)))
    r = out[0].immediate_response
    assert r.status.code == 429 and seen == [("tenant-a", -1)] and not hasattr(picker, "routed")
    headers = {h.header.key: h.header.raw_value.decode() for h in r.headers.set_headers}
    assert headers["x-llm-d-request-dropped-reason"] == "rejected-saturated" and headers["retry-after"] == "3"
    assert json.loads(r.body)["error"]["type"] == "rate_limit_error"
    assert metrics.requests.labels("shed")._value.get() == 1


def test_the_ticket_is_released_however_the_stream_ends():
    released = []

    class Ticket:
        def release(self):
            released.append(True)

    async def admission(headers, priority):
        return Ticket()

    ex, _ = _exchange(RecordingPicker(), admission)
    run(ex.on(_headers(eos=True)))
    ex.close()                      # Envoy cancelled before any response
    assert released and ex.picker.credits == ["finished"]


def test_probe_health_tells_liveness_from_readiness():
    ready = [False]
    probes = ProbeHealth(lambda: ready[0])

    def check(name):
        return run(probes.Check(health_pb2.HealthCheckRequest(service=name), None)).status

    assert check("liveness") == health_pb2.HealthCheckResponse.SERVING
    assert check("readiness") == check("") == health_pb2.HealthCheckResponse.NOT_SERVING
    ready[0] = True
    assert check("envoy.service.ext_proc.v3.ExternalProcessor") == health_pb2.HealthCheckResponse.SERVING
    assert check("something-else") == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
