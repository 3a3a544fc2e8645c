"""The worker pod's readiness probe: an active canary, not just "the port is open".

`python -m splitserve.operator.probe --address 127.0.0.1:50051` exits 0 only when
the worker's gRPC health is SERVING (model loaded, not draining) and a canary
Generate of one greedy token on a one-token prompt finishes. The operator builds
rank-0 pods with this as an exec readinessProbe (and a plain gRPC startupProbe
for the slow model load); it counts a group ready when all its pods are Ready.
With mutual TLS to the workers, SPLITSERVE_TLS_CA / _CLIENT_CERT / _CLIENT_KEY
(/ _SERVER_NAME) name the files, as for the operator's drain calls.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.tls import TlsConfig


async def canary(address: str, timeout_s: float) -> str | None:
    """None when the worker passes; else what failed."""
    from splitserve.proto.v1 import common_pb2, worker_pb2, worker_pb2_grpc

    async with TlsConfig.client_from_env().aio_channel(address) as channel:
        try:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return f"health check failed: {exc.code().name}"
        if health.status != health_pb2.HealthCheckResponse.SERVING:
            return f"health is {health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)}"
        request = worker_pb2.TokenGenerateRequest(
            request_id=f"canary-{uuid.uuid4().hex[:8]}", token_ids=[1],
            params=common_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        try:
            async for reply in worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=timeout_s):
                if reply.finished:
                    return None if reply.num_output_tokens == 1 else "canary produced no token"
        except grpc.aio.AioRpcError as exc:
            return f"canary Generate failed: {exc.code().name}: {exc.details()}"
    return "canary stream ended without finishing"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m splitserve.operator.probe",
                                     description="Readiness canary for a splitserve worker.")
    parser.add_argument("--address", default="127.0.0.1:50051", help="worker gRPC address")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per call")
    args = parser.parse_args(argv)
    problem = asyncio.run(canary(args.address, args.timeout))
    if problem:
        print(f"not ready: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
