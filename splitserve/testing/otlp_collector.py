"""A real OTLP trace receiver for the tests: opentelemetry-proto's TraceService on 127.0.0.1.

`OtlpCollector.start()` serves the OTLP/gRPC trace service that `--otlp-traces-endpoint`
exports to and keeps every span it receives, with the `service.name` and
`service.instance.id` of the process that sent it (and all its resource attributes). The tests read `spans` (a copy, safe
while exports arrive) and wait for the ones they expect; nothing here sleeps.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from splitserve.net import free_port


@dataclass(slots=True, frozen=True)
class ReceivedSpan:
    service: str                   # the exporter's service.name
    instance: str                  # its service.instance.id ("" when unset)
    trace_id: str                  # hex
    span_id: str
    parent_span_id: str            # "" for a root
    name: str
    kind: int                      # opentelemetry.proto.trace.v1.Span.SpanKind
    attributes: dict[str, object]
    status_code: int               # 0 unset, 1 ok, 2 error
    resource: dict[str, object]    # every resource attribute of the exporter (k8s.pod.name, ...)


def _value(v) -> object:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collector: OtlpCollector) -> None:
        self.collector = collector

    def Export(self, request, context):
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    received.append(ReceivedSpan(
                        str(resource.get("service.name", "")), str(resource.get("service.instance.id", "")),
                        s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name, s.kind,
                        {a.key: _value(a.value) for a in s.attributes}, s.status.code, resource))
        with self.collector.lock:
            self.collector.received.extend(received)
            self.collector.num_exports += 1
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpCollector:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.received: list[ReceivedSpan] = []
        self.num_exports = 0
        self.port = 0
        self._server: grpc.Server | None = None

    @classmethod
    def start(cls) -> OtlpCollector:
        collector = cls()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(collector), server)
        collector.port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
        server.start()
        collector._server = server
        return collector

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.received)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(1).wait()

    def __enter__(self) -> OtlpCollector:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
