"""The endpoint picker protocol's names and the ext_proc messages an EPP sends.

Gateway API Inference Extension, `docs/proposals/004-endpoint-picker-protocol`: the picked
endpoint goes in the request header `x-gateway-destination-endpoint` and, with the same value, in
the dynamic metadata namespace `envoy.lb`; the proxy's subset hint arrives in the filter metadata
namespace `envoy.lb.subset_hint`; no ready endpoint is a 503 and a shed request a 429, both as an
`ImmediateResponse`. llm-d's names: the prefill pick in `x-prefiller-host-port`, a shed request's
reason in `x-llm-d-request-dropped-reason`. In FULL_DUPLEX_STREAMED mode every body chunk is sent
back (at most 62,000 bytes a message, as GIE's EPP chunks), the last with `end_of_stream`.

The messages are splitserve's wire-compatible copy of Envoy's (proto/splitserve/v1/ext_proc.proto),
served and called under Envoy's method path by `add_ext_proc_handler` and `process_call`.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import struct_pb2

from splitserve.proto.v1 import ext_proc_pb2

DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
PREFILLER_HEADER = "x-prefiller-host-port"
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS_METHOD = f"/{EXT_PROC_SERVICE}/Process"
BODY_CHUNK_BYTES = 62_000
# Never echoed to the model server: what the picker owns, and Content-Length (the body is
# re-sent in chunks, so Envoy forwards it chunked whatever it said).
SYSTEM_HEADERS = frozenset({DESTINATION_HEADER, f"{DESTINATION_HEADER}-served", SUBSET_KEY, PREFILLER_HEADER,
                            "content-length"})


def add_ext_proc_handler(server: grpc.aio.Server, process) -> None:
    """Serve `process(request_iterator, context)` (an async generator of ProcessingResponse) as
    Envoy's `ExternalProcessor.Process` bidirectional stream."""
    handler = grpc.stream_stream_rpc_method_handler(
        process, request_deserializer=ext_proc_pb2.ProcessingRequest.FromString,
        response_serializer=ext_proc_pb2.ProcessingResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(EXT_PROC_SERVICE, {"Process": handler}),))


def process_call(channel: grpc.aio.Channel):
    """The client side of `ExternalProcessor.Process` on `channel` (tests, benchmarks): call it
    with an async iterator of ProcessingRequest, iterate the ProcessingResponses."""
    return channel.stream_stream(PROCESS_METHOD, request_serializer=ext_proc_pb2.ProcessingRequest.SerializeToString,
                                 response_deserializer=ext_proc_pb2.ProcessingResponse.FromString)


def header(key: str, value: str) -> ext_proc_pb2.HeaderValueOption:
    return ext_proc_pb2.HeaderValueOption(header=ext_proc_pb2.HeaderValue(key=key, raw_value=value.encode()))


def header_map(headers: ext_proc_pb2.HeaderMap) -> dict[str, str]:
    """Envoy's headers (lower-case keys; the value in raw_value, or value from older proxies)."""
    return {h.key.lower(): (h.raw_value.decode("latin-1") if h.raw_value else h.value) for h in headers.headers}


def route_to(endpoints: list[str], prefill: str = "") -> ext_proc_pb2.ProcessingResponse:
    """The request-headers answer: the picked endpoints (primary first) in the header and in
    `envoy.lb`, and the prefill worker for the model server's frontend (a client's own
    `x-prefiller-host-port` never reaches it: removed when there is no prefill pick)."""
    value = ",".join(endpoints)
    sets = [header(DESTINATION_HEADER, value)]
    if prefill:
        sets.append(header(PREFILLER_HEADER, prefill))
    mutation = ext_proc_pb2.HeaderMutation(set_headers=sets,
                                           remove_headers=[] if prefill else [PREFILLER_HEADER])
    metadata = struct_pb2.Struct()
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: value}})
    return ext_proc_pb2.ProcessingResponse(
        request_headers=ext_proc_pb2.HeadersResponse(response=ext_proc_pb2.CommonResponse(
            clear_route_cache=True, header_mutation=mutation)),
        dynamic_metadata=metadata)


def body_chunks(phase: str, data: bytes, end_of_stream: bool) -> list[ext_proc_pb2.ProcessingResponse]:
    """`data` sent on (phase: request_body | response_body) in chunks; an empty last chunk is still sent."""
    parts = [data[i:i + BODY_CHUNK_BYTES] for i in range(0, len(data), BODY_CHUNK_BYTES)] or [b""]
    return [ext_proc_pb2.ProcessingResponse(**{phase: ext_proc_pb2.BodyResponse(response=ext_proc_pb2.CommonResponse(
        body_mutation=ext_proc_pb2.BodyMutation(streamed_response=ext_proc_pb2.StreamedBodyResponse(
            body=part, end_of_stream=end_of_stream and i == len(parts) - 1))))})
        for i, part in enumerate(parts)]


def continue_headers(phase: str) -> ext_proc_pb2.ProcessingResponse:
    """The answer to request or response headers that changes nothing (it is still required)."""
    return ext_proc_pb2.ProcessingResponse(**{phase: ext_proc_pb2.HeadersResponse(
        response=ext_proc_pb2.CommonResponse())})


def continue_trailers(phase: str) -> ext_proc_pb2.ProcessingResponse:
    return ext_proc_pb2.ProcessingResponse(**{phase: ext_proc_pb2.TrailersResponse()})


def immediate(status: int, body: bytes, headers: Iterable[tuple[str, str]] = ()) -> ext_proc_pb2.ProcessingResponse:
    """Answer the client now (the request never reaches a model server)."""
    return ext_proc_pb2.ProcessingResponse(immediate_response=ext_proc_pb2.ImmediateResponse(
        status=ext_proc_pb2.HttpStatus(code=status), body=body,
        headers=ext_proc_pb2.HeaderMutation(set_headers=[header(k, v) for k, v in headers])))


def subset_hint(request: ext_proc_pb2.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the proxy allows (`envoy.lb.subset_hint`), or None: every endpoint. A list, or
    a comma-separated string as GIE's lightweight EPP also reads."""
    namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items = [v.string_value for v in value.list_value.values]
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        items = []
    return frozenset(item.strip() for item in items if item.strip())
