"""splitserve/tracing.py: off unless asked, W3C context in and out, a clear error without the
packages; and `serve` hands the flag to every process it starts."""

from __future__ import annotations

import sys

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from splitserve.services.cli.main import main
from splitserve.services.cli.parsers import build_parser
from splitserve.services.launch.children import frontend_argv, worker_argv
from splitserve.tracing import (ENDPOINT_ENV, PROTOCOL_ENV, TraceContext, Tracer, TracingUnavailableError,
                                require_tracing, resolve_endpoint, start_tracer)

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
EXPORTER_MODULE = "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"


def test_tracing_is_off_unless_the_flag_or_the_traces_endpoint_variable_names_an_endpoint():
    assert resolve_endpoint(None, {}) is None and start_tracer("frontend", None) is None
    assert resolve_endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://all:4317"}) is None  # not traces' own
    assert resolve_endpoint(None, {ENDPOINT_ENV: "http://env:4317"}) == "http://env:4317"
    assert resolve_endpoint("http://flag:4317", {ENDPOINT_ENV: "http://env:4317"}) == "http://flag:4317"


def test_trace_context_is_read_from_asgi_headers_and_grpc_metadata():
    asgi = [(b"content-type", b"application/json"), (b"traceparent", TRACEPARENT.encode()), (b"tracestate", b"a=1")]
    assert TraceContext.from_pairs(asgi) == TraceContext(TRACEPARENT, "a=1")
    assert TraceContext.from_pairs((("TraceParent", TRACEPARENT),)) == TraceContext(TRACEPARENT)
    assert TraceContext.from_pairs([(b"tracestate", b"a=1")]) is None     # no traceparent: not traced


def _tracer() -> tuple[Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracer(provider, provider.get_tracer("test")), exporter


def test_spans_continue_the_callers_context_and_hand_their_own_on():
    tracer, exporter = _tracer()
    root = tracer.start_span("llm_request", TraceContext(TRACEPARENT, "a=1"), "server")
    passed_on = tracer.context_of(root)
    child = tracer.start_span("generate", passed_on, "server")      # in the next process
    child.end()
    root.end()
    alone = tracer.start_span("alone")
    tracer.fail(alone, "the worker went away")
    alone.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert format(spans["llm_request"].context.trace_id, "032x") == TRACE_ID
    assert format(spans["llm_request"].parent.span_id, "016x") == PARENT_ID
    assert passed_on.traceparent.split("-")[1:3] == [TRACE_ID, format(root.get_span_context().span_id, "016x")]
    assert passed_on.tracestate == "a=1"
    assert spans["generate"].parent.span_id == root.get_span_context().span_id
    assert spans["alone"].parent is None and spans["alone"].status.description == "the worker went away"
    assert spans["alone"].context.trace_id != spans["llm_request"].context.trace_id


def test_the_flag_without_opentelemetry_installed_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, EXPORTER_MODULE, None)       # as if the extra were not installed
    with pytest.raises(TracingUnavailableError, match=r"pip install 'splitserve\[tracing\]'"):
        require_tracing()
    code = main(["frontend", "--worker", "both=127.0.0.1:1", "--otlp-traces-endpoint", "http://127.0.0.1:4317"])
    assert code == 2
    assert "--otlp-traces-endpoint needs OpenTelemetry" in capsys.readouterr().err


def test_only_the_grpc_protocol_is_accepted(monkeypatch):
    monkeypatch.setenv(PROTOCOL_ENV, "http/protobuf")
    with pytest.raises(TracingUnavailableError, match="OTLP/gRPC only"):
        start_tracer("frontend", "http://127.0.0.1:4317")


@pytest.mark.parametrize("given", [[], ["--otlp-traces-endpoint", "http://127.0.0.1:4317"]])
def test_serve_gives_the_flag_to_its_workers_and_frontends(given):
    parser = build_parser()
    serve = parser.parse_args(["serve", *given])
    expected = given[1] if given else None
    worker = parser.parse_args(worker_argv(serve, "decode-0", "decode", 50051, "/m"))
    frontend = parser.parse_args(["frontend", *frontend_argv(serve, "/m", "127.0.0.1", 8000, 8001, [], [])])
    assert worker.otlp_traces_endpoint == frontend.otlp_traces_endpoint == expected
