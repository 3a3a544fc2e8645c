"""Flow control (issue 40) under real processes: one worker, two frontends with --flow-control.

- "fair" (room for one request, a band of 4): tenant A floods with 12 concurrent clients while
  tenant B sends its requests one after another; A gets 429s with llm-d's dropped reason and
  Retry-After, B gets every answer, whole, with no error and no time-out (B never holds the most
  requests in the band, so a full band drops A's newest, never B's; the tenants take turns).
- "bands" (room for one, bands 0, 10 and 20): a long request holds the room; three priority-10
  requests and then a priority -5 request (band 0) queue behind it; when the holder leaves, the
  high one is dispatched first. Deterministic: while it runs it holds the only unit, so the three
  are all still queued, undispatched, and that is read from the frontend's metrics. The same
  frontend sheds a request whose TTFT deadline passes in the queue (rejected-ttl-expired) and,
  over gRPC, one that finds its band full (RESOURCE_EXHAUSTED with the reason in the trailers).

The tiny random Llama (tests/conftest.py) keeps every request short; the holders ask for 3000
tokens with EOS ignored and are closed by the test long before that.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from splitserve.proto.v1 import inference_pb2, inference_pb2_grpc
from splitserve.testing.cluster import Cluster
from splitserve.testing.openai_api import served_model_name
from splitserve.testing.waiting import wait_until
from splitserve.testing.workers import wait_idle

FAIRNESS = "x-llm-d-inference-fairness-id"
DROPPED = "x-llm-d-request-dropped-reason"
QUEUED = "splitserve_flow_control_queued_requests"
DISPATCHED = "splitserve_flow_control_dispatched_total"
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def deployment(llama_dir):
    cluster = Cluster(llama_dir)
    try:
        cluster.start_worker("worker-0", "both").wait_ready()
        fronts = {
            "fair": cluster.start_frontend("--flow-control", "--max-concurrency", "1", "--priority-band", "0",
                                           "--max-queue", "4"),
            "bands": cluster.start_frontend("--flow-control", "--max-concurrency", "1", "--priority-band", "0",
                                            "--priority-band", "10,max-queue=3", "--priority-band", "20"),
        }
        for front in fronts.values():
            front.wait_ready()
        yield cluster, fronts
    finally:
        codes = cluster.close()
    cluster.assert_clean_exit(codes, 3)


@pytest.fixture(scope="module")
def model_name(deployment):
    return served_model_name(deployment[1]["fair"].openai_url)


def _body(model: str, max_tokens: int, **extra) -> dict:
    return {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, **extra}


def _assert_idle(cluster: Cluster, front) -> None:
    """Nothing left behind: no request queued or running in the frontend, none on the worker."""
    wait_until(lambda: front.metric(QUEUED) == 0 and front.metric("splitserve_requests_in_flight") == 0,
               timeout=10, what="the frontend's queues and requests to empty", details=front.metrics)
    wait_idle(cluster.workers.values(), 10)


def test_a_flooding_tenant_gets_429s_and_the_other_tenant_every_answer(deployment, model_name):
    cluster, fronts = deployment
    front = fronts["fair"]
    stop = threading.Event()
    flood: list[httpx.Response] = []
    flood_errors: list[BaseException] = []

    def flooder() -> None:
        with httpx.Client(base_url=front.openai_url, timeout=TIMEOUT_S, headers={FAIRNESS: "tenant-a"}) as client:
            while not stop.is_set():
                try:
                    flood.append(client.post("/completions", json=_body(model_name, 8)))
                except httpx.HTTPError as exc:          # a time-out or a broken connection: a failure below
                    flood_errors.append(exc)

    steady: list[httpx.Response] = []
    with ThreadPoolExecutor(12) as pool:
        flooders = [pool.submit(flooder) for _ in range(12)]
        try:
            wait_until(lambda: any(r.status_code == 429 for r in flood), timeout=TIMEOUT_S,
                       what="tenant A's first 429", details=lambda: [r.status_code for r in flood][-20:])
            with httpx.Client(base_url=front.openai_url, timeout=TIMEOUT_S, headers={FAIRNESS: "tenant-b"}) as b:
                for i in range(6):
                    body = _body(model_name, 8) if i % 2 else {
                        "model": model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                        "ignore_eos": True, "temperature": 0}
                    steady.append(b.post("/completions" if i % 2 else "/chat/completions", json=body))
        finally:
            stop.set()
            for f in flooders:
                f.result()
    assert [r.status_code for r in steady] == [200] * 6, [r.text for r in steady]
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in steady)
    assert not flood_errors, flood_errors
    statuses = {r.status_code for r in flood}
    assert statuses <= {200, 429}, statuses
    shed = [r for r in flood if r.status_code == 429]
    assert any(r.status_code == 200 for r in flood) and shed       # A is served its turns, its excess shed
    for r in shed:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "rate_limit_error"
        assert r.headers[DROPPED] == error["code"] == "rejected-saturated", (r.headers, error)
        assert int(r.headers["retry-after"]) >= 1
    assert front.metric("splitserve_rejected_requests_total", protocol="http", reason="shed") == len(shed)
    assert front.metric("splitserve_flow_control_shed_total", reason="rejected-saturated") == len(shed)
    assert front.metric("splitserve_flow_control_shed_total") == len(shed)        # nothing else was shed
    _assert_idle(cluster, front)


class _Holder:
    """A streamed request on a client of its own; entering waits for the response's headers, which
    come once the request was dispatched and has its first token. It holds its unit of room until
    `close()` (the client goes away)."""

    def __init__(self, base_url: str, body: dict, **kwargs) -> None:
        self._client = httpx.Client(base_url=base_url, timeout=TIMEOUT_S)
        self._cm = self._client.stream("POST", "/completions", json={**body, "stream": True}, **kwargs)
        self.response = self._cm.__enter__()
        self.lines = self.response.iter_lines()

    def next_event(self) -> dict:
        line = next(line for line in self.lines if line.startswith("data: "))
        return json.loads(line[len("data: "):])

    def running(self) -> bool:
        """It streams on: its next event has no finish reason yet."""
        return self.next_event()["choices"][0]["finish_reason"] is None

    def close(self) -> None:
        self._cm.__exit__(None, None, None)
        self._client.close()


def _post(front, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{front.openai_url}/completions", json=body, timeout=TIMEOUT_S, **kwargs)


def test_a_high_priority_request_overtakes_queued_low_priority_ones(deployment, model_name):
    cluster, fronts = deployment
    front = fronts["bands"]
    long = _body(model_name, 3000)
    low_before, high_before = front.metric(DISPATCHED, band="10"), front.metric(DISPATCHED, band="0")
    holder = _Holder(front.openai_url, long)
    with ThreadPoolExecutor(4) as pool:
        try:
            assert holder.response.status_code == 200 and holder.running()     # the room is taken
            lows = [pool.submit(_post, front, _body(model_name, 4, priority=10)) for _ in range(3)]
            wait_until(lambda: front.metric(QUEUED, band="10") == 3, timeout=TIMEOUT_S,
                       what="three low ones queued", details=front.metrics)
            high = pool.submit(_Holder, front.openai_url, {**long, "priority": -5})   # below every band: 0's
            wait_until(lambda: front.metric(QUEUED, band="0") == 1, timeout=TIMEOUT_S,
                       what="the high one queued", details=front.metrics)
            assert front.metric(DISPATCHED, band="10") == low_before
            assert not any(f.done() for f in lows) and holder.running()
        finally:
            holder.close()                  # the client goes: its unit is the next request's
        high = high.result(TIMEOUT_S)
        try:
            assert high.response.status_code == 200 and high.running()
            # The high one runs and holds the only unit: no low one was dispatched before it.
            assert front.metric(QUEUED, band="10") == 3 and front.metric(DISPATCHED, band="10") == low_before
        finally:
            high.close()
        assert [f.result(TIMEOUT_S).status_code for f in lows] == [200] * 3
    assert front.metric(DISPATCHED, band="10") == low_before + 3
    assert front.metric(DISPATCHED, band="0") == high_before + 2
    _assert_idle(cluster, front)


def test_a_passed_ttft_deadline_and_a_full_band_are_shed_on_both_apis(deployment, model_name):
    cluster, fronts = deployment
    front = fronts["bands"]
    passed_before = front.metric("splitserve_flow_control_shed_total", cause="deadline_passed")
    grpc_shed_before = front.metric("splitserve_rejected_requests_total", protocol="grpc", reason="shed")
    holder = _Holder(front.openai_url, _body(model_name, 3000))
    with ThreadPoolExecutor(3) as pool:
        try:
            assert holder.running()
            # Band 20 (no other test's): no dispatch measured yet, so no wait is estimated on arrival
            # and the request waits until its deadline passes.
            started = time.monotonic()
            late = _post(front, _body(model_name, 4, priority=25), headers={"x-llm-d-slo-ttft-ms": "300"})
            waited = time.monotonic() - started
            assert late.status_code == 429 and late.headers[DROPPED] == "rejected-ttl-expired", late.text
            assert 0.3 <= waited < 10 and "deadline" in late.json()["error"]["message"]
            lows = [pool.submit(_post, front, _body(model_name, 4, priority=10)) for _ in range(3)]
            wait_until(lambda: front.metric(QUEUED, band="10") == 3, timeout=TIMEOUT_S, what="band 10 full",
                       details=front.metrics)
            with grpc.insecure_channel(front.grpc_address) as channel:
                call = inference_pb2_grpc.InferenceStub(channel).Generate(
                    inference_pb2.GenerateRequest(model=model_name, text="Hello", max_tokens=2, priority=10),
                    timeout=TIMEOUT_S)
                with pytest.raises(grpc.RpcError) as info:
                    list(call)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(info.value.trailing_metadata())[DROPPED] == "rejected-saturated"
            assert front.metric("splitserve_rejected_requests_total", protocol="grpc", reason="shed") == \
                grpc_shed_before + 1
            bad = _post(front, _body(model_name, 4), headers={"x-llm-d-slo-ttft-ms": "soon"})
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_header"
            assert holder.running()
        finally:
            holder.close()
        assert [f.result(TIMEOUT_S).status_code for f in lows] == [200] * 3
    assert front.metric("splitserve_flow_control_shed_total", cause="deadline_passed") == passed_before + 1
    _assert_idle(cluster, front)
