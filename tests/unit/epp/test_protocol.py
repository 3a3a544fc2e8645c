"""The endpoint picker protocol's messages (services/epp/protocol.py)."""

from __future__ import annotations

from google.protobuf import struct_pb2

from splitserve.proto.v1 import ext_proc_pb2
from splitserve.services.epp import protocol


def _hinted(value) -> ext_proc_pb2.ProcessingRequest:
    request = ext_proc_pb2.ProcessingRequest()
    hint = struct_pb2.Struct()
    hint.update(value)
    request.metadata_context.filter_metadata[protocol.SUBSET_NAMESPACE].CopyFrom(hint)
    return request


def test_subset_hint_forms():
    assert protocol.subset_hint(ext_proc_pb2.ProcessingRequest()) is None               # no namespace: all
    assert protocol.subset_hint(_hinted({"other": 1})) is None                           # namespace, no key: all
    assert protocol.subset_hint(_hinted({protocol.SUBSET_KEY: ["10.0.0.1:8000", "10.0.0.2:8000"]})) == \
        {"10.0.0.1:8000", "10.0.0.2:8000"}
    assert protocol.subset_hint(_hinted({protocol.SUBSET_KEY: "10.0.0.1:8000, 10.0.0.3:8000"})) == \
        {"10.0.0.1:8000", "10.0.0.3:8000"}
    assert protocol.subset_hint(_hinted({protocol.SUBSET_KEY: []})) == frozenset()       # empty: none (503)


def test_route_to_sets_header_and_metadata_alike():
    r = protocol.route_to(["10.0.0.1:8000", "10.0.0.2:8000"], prefill="10.0.0.9:50051")
    common = r.request_headers.response
    assert common.clear_route_cache
    headers = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    assert headers == {"x-gateway-destination-endpoint": "10.0.0.1:8000,10.0.0.2:8000",
                       "x-prefiller-host-port": "10.0.0.9:50051"}
    assert r.dynamic_metadata.fields["envoy.lb"].struct_value.fields[
        "x-gateway-destination-endpoint"].string_value == headers["x-gateway-destination-endpoint"]
    assert list(common.header_mutation.remove_headers) == []
    # Without a prefill pick, a client's own x-prefiller-host-port never reaches the pod.
    assert list(protocol.route_to(["10.0.0.1:8000"]).request_headers.response.header_mutation.remove_headers) == \
        ["x-prefiller-host-port"]


def test_body_chunks_split_at_the_limit_and_mark_only_the_last():
    data = bytes(range(256)) * 500            # 128,000 bytes: three chunks
    chunks = protocol.body_chunks("request_body", data, True)
    parts = [c.request_body.response.body_mutation.streamed_response for c in chunks]
    assert [len(p.body) for p in parts] == [62_000, 62_000, 4_000]
    assert b"".join(p.body for p in parts) == data
    assert [p.end_of_stream for p in parts] == [False, False, True]
    # An empty last chunk is still sent (Envoy's terminating chunk), and a middle one is not final.
    assert [c.response_body.response.body_mutation.streamed_response.end_of_stream
            for c in protocol.body_chunks("response_body", b"", True)] == [True]
    assert not protocol.body_chunks("response_body", b"x", False)[0].response_body.response.body_mutation \
        .streamed_response.end_of_stream


def test_immediate_response_and_header_map():
    r = protocol.immediate(429, b'{"error": {}}', [("x-llm-d-request-dropped-reason", "rejected-saturated")])
    assert r.immediate_response.status.code == 429 and r.immediate_response.body == b'{"error": {}}'
    assert r.immediate_response.headers.set_headers[0].header.key == "x-llm-d-request-dropped-reason"
    headers = ext_proc_pb2.HeaderMap(headers=[ext_proc_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
                                          ext_proc_pb2.HeaderValue(key="X-Old", value="plain")])
    assert protocol.header_map(headers) == {":path": "/v1/completions", "x-old": "plain"}
