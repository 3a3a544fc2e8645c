"""OpenTelemetry tracing end to end (issue 37): one disaggregated request is one trace.

`splitserve serve --otlp-traces-endpoint` (1 prefill + 1 decode worker over TCP) exports to
a real OTLP/gRPC receiver this test serves (splitserve/testing/otlp_collector.py). A request
that carries the client's W3C `traceparent` must come back as spans of that trace from the
frontend and from both workers, each hanging below the span that called it (frontend →
decode worker in TokenGenerateRequest, decode → prefill worker in PrefillRequest), with
the GenAI attributes equal to the response's usage. With the flag off, a process exports
nothing and says nothing about tracing, even with a collector in the OTel environment.
"""

from __future__ import annotations

import secrets

import grpc
import httpx
import openai
import pytest

from splitserve.proto.v1 import inference_pb2, inference_pb2_grpc
from splitserve.testing.models import random_prompt
from splitserve.testing.otlp_collector import OtlpCollector, ReceivedSpan
from splitserve.testing.waiting import wait_until

from .conftest import start_serve, stop_serve

THRESHOLD = 32
MAX_TOKENS = 5
SPAN_KIND_SERVER, SPAN_KIND_CLIENT = 2, 3
# The spans of one disaggregated request: (service, name) -> the (service, name) of its parent.
TREE = {
    ("splitserve-frontend", "route"): ("splitserve-frontend", "llm_request"),
    ("splitserve-frontend", "worker_call"): ("splitserve-frontend", "llm_request"),
    ("decode-0", "generate"): ("splitserve-frontend", "worker_call"),
    ("decode-0", "queue"): ("decode-0", "generate"),
    ("decode-0", "remote_prefill"): ("decode-0", "generate"),
    ("decode-0", "decode"): ("decode-0", "generate"),
    ("prefill-0", "prefill"): ("decode-0", "remote_prefill"),
    ("prefill-0", "kv_transfer"): ("prefill-0", "prefill"),
}
EXPECTED = {("splitserve-frontend", "llm_request"), *TREE}


@pytest.fixture(scope="module")
def collector():
    with OtlpCollector.start() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def traced(llama_dir, collector):
    # A short batch delay: spans leave each process within 0.1 s of ending.
    server = start_serve(str(llama_dir), "--transfer", "tcp", "--prefill-workers", "1", "--decode-workers", "1",
                         "--remote-prefill-threshold", str(THRESHOLD), "--otlp-traces-endpoint", collector.endpoint,
                         env={"OTEL_BSP_SCHEDULE_DELAY": "100"}, num_workers=2, aggregated=False)
    try:
        yield server
    finally:
        stop_serve(server)


def _traceparent() -> tuple[str, str, str]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent_id}-01", trace_id, parent_id


def _who(span: ReceivedSpan) -> tuple[str, str]:
    """(service, name), with a worker named by its instance (decode-0, prefill-0)."""
    return (span.instance if span.service == "splitserve-worker" else span.service), span.name


def _whole_trace(collector: OtlpCollector, trace_id: str) -> dict[tuple[str, str], ReceivedSpan]:
    def complete():
        spans = {_who(s): s for s in collector.trace(trace_id)}
        return spans if EXPECTED <= spans.keys() else None
    return wait_until(complete, timeout=30, what=f"every span of trace {trace_id}",
                      details=lambda: sorted(_who(s) for s in collector.trace(trace_id)))


def test_a_disaggregated_request_is_one_trace_across_frontend_and_both_workers(traced, collector):
    traceparent, trace_id, client_span_id = _traceparent()
    client = openai.OpenAI(base_url=traced.openai_url, api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    prompt = random_prompt(7, 100)         # well over the threshold: prefilled on the prefill worker
    out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_headers={"traceparent": traceparent})
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == MAX_TOKENS

    spans = _whole_trace(collector, trace_id)
    assert all(s.trace_id == trace_id for s in collector.trace(trace_id))
    root = spans["splitserve-frontend", "llm_request"]
    assert root.parent_span_id == client_span_id and root.kind == SPAN_KIND_SERVER
    for child, parent in TREE.items():
        assert spans[child].parent_span_id == spans[parent].span_id, (child, parent)
    assert spans["decode-0", "generate"].kind == SPAN_KIND_SERVER
    assert spans["decode-0", "remote_prefill"].kind == SPAN_KIND_CLIENT
    assert spans["prefill-0", "prefill"].kind == SPAN_KIND_SERVER
    assert "decode-0" not in {_who(s)[0] for s in collector.trace(trace_id) if s.name == "prefill"}  # remote only

    a = root.attributes
    assert a["gen_ai.request.model"] == model and a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.max_tokens"] == MAX_TOKENS and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.input_tokens"] == out.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == out.usage.completion_tokens
    assert a["gen_ai.usage.prompt_tokens"] == out.usage.prompt_tokens       # vLLM's names too
    assert a["gen_ai.usage.completion_tokens"] == out.usage.completion_tokens
    assert a["gen_ai.response.finish_reasons"] == [out.choices[0].finish_reason]
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]

    route = spans["splitserve-frontend", "route"].attributes
    assert route["splitserve.route.decode.worker_id"] == "decode-0"
    assert route["splitserve.route.prefill.worker_id"] == "prefill-0"
    assert route["splitserve.route.decode.policy"] == "kv" and "splitserve.route.decode.cost" in route

    generate = spans["decode-0", "generate"].attributes
    assert generate["splitserve.prefill.remote"] is True and generate["gen_ai.latency.time_in_queue"] >= 0
    assert generate["gen_ai.usage.input_tokens"] == len(prompt)
    assert generate["gen_ai.usage.output_tokens"] == out.usage.completion_tokens
    transfer = spans["prefill-0", "kv_transfer"].attributes
    assert transfer["splitserve.kv_transfer.backend"] == "tcp"
    assert transfer["splitserve.kv_transfer.num_blocks"] == spans["decode-0", "remote_prefill"].attributes[
        "splitserve.kv_transfer.num_blocks"] > 0
    assert spans["prefill-0", "prefill"].attributes["gen_ai.usage.input_tokens"] == len(prompt)
    assert not [s for s in collector.trace(trace_id) if s.status_code == 2]      # nothing failed


def test_a_raw_http_chat_stream_continues_the_clients_trace(traced, collector):
    traceparent, trace_id, client_span_id = _traceparent()
    model = httpx.get(f"{traced.openai_url}/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "tell me a story " * 20}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    with httpx.stream("POST", f"{traced.openai_url}/chat/completions", json=body, timeout=60,
                      headers={"traceparent": traceparent, "tracestate": "client=1"}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                usage = httpx.Response(200, content=line[len("data: "):]).json()["usage"]
    assert usage is not None

    spans = _whole_trace(collector, trace_id)
    root = spans["splitserve-frontend", "llm_request"]
    assert root.parent_span_id == client_span_id
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert root.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert spans["decode-0", "generate"].parent_span_id == spans["splitserve-frontend", "worker_call"].span_id


def test_the_public_grpc_api_continues_the_trace_in_its_metadata(traced, collector):
    traceparent, trace_id, client_span_id = _traceparent()
    request = inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=random_prompt(8, 60)),
                                            max_tokens=MAX_TOKENS, temperature=0.0, include_usage=True)
    with grpc.insecure_channel(traced.grpc_address) as channel:
        replies = list(inference_pb2_grpc.InferenceStub(channel).Generate(
            request, metadata=[("traceparent", traceparent)], timeout=60))
    usage = replies[-1].usage
    spans = _whole_trace(collector, trace_id)
    root = spans["splitserve-frontend", "llm_request"]
    assert root.parent_span_id == client_span_id
    assert root.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens == MAX_TOKENS
    assert root.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens == 60


def test_without_the_flag_nothing_is_exported(llama_dir):
    # A collector the OTel environment names for every signal: the processes must still not export.
    collector = OtlpCollector.start()
    try:
        server = start_serve(str(llama_dir), env={"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
                                                  "OTEL_BSP_SCHEDULE_DELAY": "100"})
        try:
            traceparent, trace_id, _ = _traceparent()
            client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=60)
            out = client.completions.create(model=client.models.list().data[0].id, prompt="hello there",
                                            max_tokens=2, extra_headers={"traceparent": traceparent})
            assert out.usage.completion_tokens == 2
        finally:
            stop_serve(server)            # a process with a tracer exports what it holds as it exits
        assert collector.num_exports == 0 and not collector.spans
        assert "traces" not in server.proc.output, server.proc.output        # no "exporting traces to"
    finally:
        collector.stop()
