"""Real worker and frontend processes for the security tests, and a throwaway CA.

Processes come from splitserve.testing.cluster (free loopback ports, output
captured, everything stopped at the end); certificates from
splitserve.testing.certs (a CA made per module, leaves for 127.0.0.1).
"""

from __future__ import annotations

import grpc
import pytest

from splitserve.proto.v1 import inference_pb2, inference_pb2_grpc
from splitserve.testing.certs import TestCA


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("pki"))


def grpc_generate(channel: grpc.Channel, model: str, metadata=(), max_tokens: int = 3, timeout: float = 60.0):
    """One public-gRPC Generate call; returns the concatenated text (raises grpc.RpcError on refusal)."""
    stub = inference_pb2_grpc.InferenceStub(channel)
    request = inference_pb2.GenerateRequest(model=model, text="Hello there", max_tokens=max_tokens)
    return "".join(r.text for r in stub.Generate(request, metadata=metadata, timeout=timeout))
