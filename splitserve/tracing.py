"""OpenTelemetry tracing: one request followed through frontend, router, prefill, KV transfer and decode.

Off unless a process is given `--otlp-traces-endpoint URL` (vLLM's flag) or the standard
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; then `start_tracer` builds a `Tracer` that batches spans
to that OTLP/gRPC endpoint (opentelemetry-sdk's BatchSpanProcessor, so its OTEL_BSP_* settings
apply). Nothing here imports OpenTelemetry until a tracer is started: a process without the
flag holds `None` instead of a tracer, and its request path pays one `is None` test.

The context travels as W3C trace context (`traceparent`, `tracestate`): from the client's HTTP
headers or gRPC metadata into the frontend, then in the request messages (`TraceContext` in
TokenGenerateRequest and PrefillRequest, proto/splitserve/v1/) to the decode worker and from
it to the prefill worker, whose KV transfer spans join the same trace. Parents are passed
explicitly, never through a "current span", because a request's work runs in async generators
and on several tasks.

Attribute names are OpenTelemetry's GenAI semantic conventions, with vLLM's additions
(`vllm/tracing.py` SpanAttributes: request id, n, latencies, and the older usage names its
dashboards read); they are copied here rather than imported, as vLLM does, so that a change
of the incubating semconv package cannot rename them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from splitserve.errors import FatalError

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

SpanKindName = Literal["internal", "server", "client"]


class GenAI:
    """Span attribute names: the GenAI semantic conventions, then vLLM's own."""

    OPERATION_NAME = "gen_ai.operation.name"            # chat | text_completion
    REQUEST_MODEL = "gen_ai.request.model"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_TOP_K = "gen_ai.request.top_k"
    REQUEST_SEED = "gen_ai.request.seed"
    REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
    RESPONSE_MODEL = "gen_ai.response.model"
    RESPONSE_ID = "gen_ai.response.id"
    RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
    USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
    # vLLM's names (SpanAttributes), kept beside the current ones for its dashboards.
    REQUEST_ID = "gen_ai.request.id"
    REQUEST_N = "gen_ai.request.n"
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    LATENCY_E2E = "gen_ai.latency.e2e"
    LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"


class TracingUnavailableError(FatalError):
    """Tracing was asked for but cannot run (its packages are missing, or a setting is unsupported)."""


@dataclass(slots=True, frozen=True)
class TraceContext:
    """W3C trace context as it crosses a process boundary (HTTP headers, gRPC metadata, proto)."""

    traceparent: str
    tracestate: str = ""

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[Any, Any]]) -> TraceContext | None:
        """From header or metadata pairs (str or ASGI bytes; names in any case); None without a traceparent."""
        parent = state = ""
        for name, value in pairs:
            name = (name.decode("latin-1") if isinstance(name, bytes) else name).lower()
            if name == TRACEPARENT:
                parent = value.decode("latin-1") if isinstance(value, bytes) else value
            elif name == TRACESTATE:
                state = value.decode("latin-1") if isinstance(value, bytes) else value
        return cls(parent, state) if parent else None

    @classmethod
    def from_proto(cls, message) -> TraceContext | None:
        """From a proto TraceContext (an unset one has an empty traceparent: None)."""
        return cls(message.traceparent, message.tracestate) if message.traceparent else None

    def carrier(self) -> dict[str, str]:
        return {TRACEPARENT: self.traceparent, **({TRACESTATE: self.tracestate} if self.tracestate else {})}


def resolve_endpoint(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The OTLP endpoint to export to: the flag, else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else None (off)."""
    return flag or environ.get(ENDPOINT_ENV) or None


class Tracer:
    """One process's tracer. Spans are OpenTelemetry `Span`s: callers set attributes and end them."""

    def __init__(self, provider, tracer) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self._tracer = tracer
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        self._kinds = {"internal": trace.SpanKind.INTERNAL, "server": trace.SpanKind.SERVER,
                       "client": trace.SpanKind.CLIENT}

    def start_span(self, name: str, parent=None, kind: SpanKindName = "internal",
                   attributes: Mapping[str, Any] | None = None):
        """A started span whose parent is `parent`: a Span of this process, a TraceContext from
        another, or None (a new trace)."""
        if parent is None:
            context = self._trace.set_span_in_context(self._trace.INVALID_SPAN)   # a root, whatever is current
        elif isinstance(parent, TraceContext):
            context = self._propagator.extract(parent.carrier())
        else:
            context = self._trace.set_span_in_context(parent)
        return self._tracer.start_span(name, context=context, kind=self._kinds[kind], attributes=attributes)

    def context_of(self, span) -> TraceContext:
        """`span` as the parent that another process continues from."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        return TraceContext(carrier[TRACEPARENT], carrier.get(TRACESTATE, ""))

    def fail(self, span, exc: BaseException | str) -> None:
        """Mark `span` failed (status ERROR; an exception is recorded as an event)."""
        from opentelemetry.trace import Status, StatusCode

        if isinstance(exc, BaseException):
            span.record_exception(exc)
            exc = str(exc) or type(exc).__name__
        span.set_status(Status(StatusCode.ERROR, exc))

    def shutdown(self) -> None:
        """Export what is buffered and stop the exporter."""
        self.provider.shutdown()


_INSTALL = "install it with `pip install 'splitserve[tracing]'`"


def require_tracing() -> None:
    """Raises TracingUnavailableError unless the OTLP exporter can be imported (the `tracing` extra)."""
    try:
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise TracingUnavailableError(f"--otlp-traces-endpoint needs OpenTelemetry, which is not installed "
                                      f"({exc}); {_INSTALL}") from exc


def start_tracer(service_name: str, endpoint: str | None, instance_id: str | None = None) -> Tracer | None:
    """A tracer exporting to `endpoint` over OTLP/gRPC; None when `endpoint` is empty (tracing off).

    Raises TracingUnavailableError when the `tracing` extra is not installed or
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL names another protocol than grpc.
    """
    if not endpoint:
        return None
    protocol = os.environ.get(PROTOCOL_ENV, "grpc")
    if protocol != "grpc":
        raise TracingUnavailableError(f"{PROTOCOL_ENV}={protocol!r} is not supported: splitserve exports "
                                      "traces over OTLP/gRPC only (unset it, or set it to 'grpc')")
    require_tracing()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES still apply (Resource.create reads them);
    # the process's role is the default name.
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    if instance_id:
        attributes[SERVICE_INSTANCE_ID] = instance_id
    resource = Resource.create(attributes)
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return Tracer(provider, provider.get_tracer("splitserve"))
