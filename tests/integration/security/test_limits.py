"""Request limits on a real frontend and worker: body size, prompt tokens, concurrency, rate, timeout.

One worker; three frontends in front of it, each with the limits its tests need
(a frontend is cheap: a tokenizer, no weights). Every refusal is an OpenAI
error with the documented status and is counted in
splitserve_rejected_requests_total by reason; a timed-out request is cancelled
on the worker too (its KV blocks are free again).
"""

from __future__ import annotations

import json
import time

import grpc
import httpx
import pytest

from splitserve.proto.v1 import inference_pb2, inference_pb2_grpc, worker_pb2
from splitserve.testing.cluster import Cluster
from splitserve.testing.openai_api import served_model_name
from splitserve.testing.waiting import wait_until
from splitserve.testing.workers import worker_stats

from .conftest import grpc_generate

REJECTED = "splitserve_rejected_requests_total"


@pytest.fixture(scope="module")
def deployment(llama_dir):
    cluster = Cluster(llama_dir)
    try:
        cluster.start_worker("worker-0", "both").wait_ready()
        fronts = {
            "small": cluster.start_frontend("--max-body-bytes", "4096", "--max-prompt-tokens", "16",
                                            "--request-timeout", "2"),
            "one": cluster.start_frontend("--max-concurrent-per-key", "1"),
            "rate": cluster.start_frontend("--rate-limit", "0.5", "--rate-limit-burst", "2"),
        }
        for front in fronts.values():
            front.wait_ready()
        yield cluster, fronts
    finally:
        codes = cluster.close()
    cluster.assert_clean_exit(codes, 4)


@pytest.fixture(scope="module")
def fronts(deployment):
    return deployment[1]


@pytest.fixture(scope="module")
def model_name(fronts):
    return served_model_name(fronts["one"].openai_url)


def _error(reply: httpx.Response, status: int, code: str) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error


def test_body_too_large_is_413(fronts, model_name):
    front = fronts["small"]
    before = front.metric(REJECTED, protocol="http", reason="body_too_large")
    big = {"model": model_name, "prompt": "x " * 5000, "max_tokens": 2}
    _error(httpx.post(f"{front.openai_url}/completions", json=big), 413, "request_too_large")

    def chunks():                      # no Content-Length: the limit is enforced while reading
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]

    _error(httpx.post(f"{front.openai_url}/completions", content=chunks()), 413, "request_too_large")
    assert front.metric(REJECTED, protocol="http", reason="body_too_large") == before + 2
    ok = httpx.post(f"{front.openai_url}/completions", json={**big, "prompt": "short"}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_prompt_over_max_prompt_tokens_is_400(fronts, model_name):
    front = fronts["small"]
    before = front.metric(REJECTED, protocol="http", reason="invalid")
    error = _error(httpx.post(f"{front.openai_url}/completions",
                              json={"model": model_name, "prompt": list(range(1, 18)), "max_tokens": 2}),
                   400, "context_length_exceeded")
    assert "16" in error["message"] and error["param"] == "prompt"
    chat = {"model": model_name, "max_tokens": 2, "messages": [{"role": "user", "content": "word " * 40}]}
    assert _error(httpx.post(f"{front.openai_url}/chat/completions", json=chat), 400,
                  "context_length_exceeded")["param"] == "messages"
    # Far beyond what 16 tokens can spell: refused before tokenizing, as quickly.
    start = time.monotonic()
    _error(httpx.post(f"{front.openai_url}/completions",
                      json={"model": model_name, "prompt": "a" * 4000, "max_tokens": 2}), 400,
           "context_length_exceeded")
    assert time.monotonic() - start < 5
    assert front.metric(REJECTED, protocol="http", reason="invalid") == before + 3
    with grpc.insecure_channel(front.grpc_address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(inference_pb2_grpc.InferenceStub(channel).Generate(
                inference_pb2.GenerateRequest(model=model_name, text="word " * 40, max_tokens=2), timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_request_timeout_is_504_and_cancels_the_work(deployment, fronts, model_name):
    front, worker = fronts["small"], deployment[0].workers["worker-0"].address
    before = front.metric(REJECTED, protocol="http", reason="timeout")
    long = {"model": model_name, "prompt": "Once", "max_tokens": 3000, "ignore_eos": True}
    start = time.monotonic()
    error = _error(httpx.post(f"{front.openai_url}/completions", json=long, timeout=60), 504, "request_timeout")
    assert error["type"] == "timeout" and 1.5 < time.monotonic() - start < 10
    with httpx.stream("POST", f"{front.openai_url}/completions", json={**long, "stream": True}, timeout=60) as reply:
        assert reply.status_code == 200
        events = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == "request_timeout"
    assert front.metric(REJECTED, protocol="http", reason="timeout") == before + 2
    def dropped() -> worker_pb2.StatsResponse | None:
        stats = worker_stats(worker)
        return stats if stats.num_used_kv_blocks == stats.num_running == stats.num_in_flight == 0 else None

    # The worker dropped both requests: no block held, nothing running.
    stats = wait_until(dropped, timeout=5, what="the worker to drop both requests",
                       details=lambda: worker_stats(worker))
    assert stats.num_aborted >= 2


def test_concurrency_limit_is_429(fronts, model_name):
    front = fronts["one"]
    before = front.metric(REJECTED, protocol="http", reason="concurrency")
    long = {"model": model_name, "prompt": "Once", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=front.openai_url, timeout=60) as client:
        with client.stream("POST", "/completions", json=long) as held:
            assert held.status_code == 200
            lines = held.iter_lines()                   # kept: a dropped iterator closes the stream
            next(lines)                                 # the first request is running now
            second = client.post("/completions", json={**long, "stream": False, "max_tokens": 2})
            error = _error(second, 429, "concurrency")
            assert error["type"] == "rate_limit_error" and int(second.headers["retry-after"]) >= 1
            with grpc.insecure_channel(front.grpc_address) as channel:
                with pytest.raises(grpc.RpcError) as info:
                    grpc_generate(channel, model_name)
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Closing the stream cancels it; its slot comes back once the frontend has seen the disconnect.
        def admitted() -> httpx.Response | None:
            reply = client.post("/completions", json={**long, "stream": False, "max_tokens": 2})
            return reply if reply.status_code != 429 else None

        third = wait_until(admitted, timeout=10, what="the slot back (no 429)")
        assert third.status_code == 200, third.text
    assert front.metric(REJECTED, protocol="http", reason="concurrency") >= before + 1
    assert front.metric(REJECTED, protocol="grpc", reason="concurrency") == 1


def test_rate_limit_is_429_with_retry_after(fronts, model_name):
    front = fronts["rate"]
    body = {"model": model_name, "prompt": "Hi", "max_tokens": 1}
    with httpx.Client(base_url=front.openai_url, timeout=60) as client:
        statuses = [client.post("/completions", json=body) for _ in range(4)]
    assert [r.status_code for r in statuses[:2]] == [200, 200]         # the burst
    limited = [r for r in statuses[2:] if r.status_code == 429]
    assert limited, [r.status_code for r in statuses]
    error = _error(limited[0], 429, "rate_limit")
    assert error["type"] == "rate_limit_error" and 1 <= int(limited[0].headers["retry-after"]) <= 2
    assert front.metric(REJECTED, protocol="http", reason="rate_limit") == len(limited)
    assert front.get("/health")[0] == 200                             # open paths are never limited
