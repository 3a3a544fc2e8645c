"""Readiness checks of a local deployment's children: worker gRPC health, the frontend's /ready.

Blocking on purpose: the launcher's supervisor loop and the Ray worker replica's
readiness check call them from plain threads.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc
from splitserve.tls import PLAINTEXT, TlsConfig


def worker_health(address: str, tls: TlsConfig = PLAINTEXT) -> int | None:
    """The worker's gRPC health status (health_pb2.HealthCheckResponse.SERVING, NOT_SERVING...),
    None when it does not answer."""
    with tls.channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=1.0)
        except grpc.RpcError:
            return None
    return reply.status


def worker_serving(address: str, tls: TlsConfig = PLAINTEXT) -> bool:
    """The worker's gRPC health says SERVING (also the Ray worker replica's readiness check)."""
    return worker_health(address, tls) == health_pb2.HealthCheckResponse.SERVING


def http_ready(url: str) -> bool:
    """The frontend answers /ready with 200 and sees every worker ready."""
    # A readiness probe of our own child: with HTTPS its certificate is not checked here.
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=1.0, context=context) as reply:
            return reply.status == 200 and json.loads(reply.read()).get("all_workers_ready", True)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def transfer_backend(address: str, tls: TlsConfig = PLAINTEXT) -> str:
    with tls.channel(address) as channel:
        try:
            info = worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=5)
        except grpc.RpcError:
            return "unknown"
    return info.transfer_backend or "none"
