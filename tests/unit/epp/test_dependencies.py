"""The picker's ext_proc messages are splitserve's own wire-compatible copy, not xds-protos.

xds-protos (Envoy's generated protos) ships an old `opentelemetry/proto/*` over
opentelemetry-proto's, which breaks tracing wherever both are installed; so splitserve neither
depends on it nor imports `envoy.*` protos. The field numbers below are Envoy 1.40's
(api/envoy/service/ext_proc/v3/external_processor.proto, config/core/v3/base.proto,
type/v3/http_status.proto); a renumbered field would make a real Envoy misread the picker.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from splitserve.proto.v1 import ext_proc_pb2

ROOT = Path(__file__).resolve().parents[3]

ENVOY_FIELDS = {
    "HeaderValue": {"key": 1, "value": 2, "raw_value": 3},
    "HeaderValueOption": {"header": 1, "append": 2, "append_action": 3, "keep_empty_value": 4},
    "HeaderMap": {"headers": 1},
    "Metadata": {"filter_metadata": 1},
    "HttpStatus": {"code": 1},
    "HttpHeaders": {"headers": 1, "end_of_stream": 3},
    "HttpBody": {"body": 1, "end_of_stream": 2},
    "HttpTrailers": {"trailers": 1},
    "ProcessingRequest": {"request_headers": 2, "response_headers": 3, "request_body": 4, "response_body": 5,
                          "request_trailers": 6, "response_trailers": 7, "metadata_context": 8,
                          "observability_mode": 10},
    "HeaderMutation": {"set_headers": 1, "remove_headers": 2},
    "StreamedBodyResponse": {"body": 1, "end_of_stream": 2},
    "BodyMutation": {"body": 1, "clear_body": 2, "streamed_response": 3},
    "CommonResponse": {"status": 1, "header_mutation": 2, "body_mutation": 3, "trailers": 4, "clear_route_cache": 5},
    "HeadersResponse": {"response": 1},
    "BodyResponse": {"response": 1},
    "TrailersResponse": {"header_mutation": 1},
    "GrpcStatus": {"status": 1},
    "ImmediateResponse": {"status": 1, "headers": 2, "body": 3, "grpc_status": 4, "details": 5},
    "ProcessingResponse": {"request_headers": 1, "response_headers": 2, "request_body": 3, "response_body": 4,
                           "request_trailers": 5, "response_trailers": 6, "immediate_response": 7,
                           "dynamic_metadata": 8},
}


def test_ext_proc_messages_keep_envoys_field_numbers():
    for message, fields in ENVOY_FIELDS.items():
        descriptor = getattr(ext_proc_pb2, message).DESCRIPTOR
        assert {f.name: f.number for f in descriptor.fields} == fields, message


def test_a_response_envoy_encoded_parses_here():
    # ProcessingResponse{request_headers{response{clear_route_cache: true}}}, as Envoy's own
    # protos encode it: field 1 (len 4) { field 1 (len 2) { field 5 varint 1 } }.
    envoy_bytes = bytes([0x0A, 0x04, 0x0A, 0x02, 0x28, 0x01])
    response = ext_proc_pb2.ProcessingResponse.FromString(envoy_bytes)
    assert response.WhichOneof("response") == "request_headers"
    assert response.request_headers.response.clear_route_cache is True
    assert response.SerializeToString() == envoy_bytes


def test_splitserve_does_not_depend_on_xds_protos():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements.extend(extra)
    assert not [r for r in requirements if r.lower().replace("_", "-").startswith("xds-protos")]


def test_the_picker_loads_no_envoy_protos_and_opentelemetry_protos_are_whole():
    code = ("import sys, splitserve.services.epp.server, splitserve.services.epp.exchange\n"
            "print(sorted(m for m in sys.modules if m.startswith(('envoy.', 'xds.', 'udpa.', 'validate.'))))\n"
            "from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
