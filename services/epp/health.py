"""The endpoint picker's gRPC health, as the protocol and llm-d's probes ask.

On the ext_proc port the standard `grpc.health.v1.Health` answers for "" and
`envoy.service.ext_proc.v3.ExternalProcessor` (Envoy's active health check of the picker cluster
uses that name: a picker that is not ready is skipped, so a FailOpen gateway falls back at once).
The health port answers `liveness` (SERVING while the process answers) and `readiness` (plus ""
and the ext_proc name: SERVING once the picker knows its pool: the workers listed at least once,
and not draining); any other name is SERVICE_UNKNOWN. `Watch` on the health port is not served.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitserve.services.epp.protocol import EXT_PROC_SERVICE

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
READINESS_NAMES = ("", "readiness", EXT_PROC_SERVICE)


class ProbeHealth(health_pb2_grpc.HealthServicer):
    """The health port's `Check`: liveness apart from readiness."""

    def __init__(self, ready: Callable[[], bool]):
        self.ready = ready

    async def Check(self, request, context):  # noqa: N802 - the gRPC method's name
        if request.service == "liveness":
            return health_pb2.HealthCheckResponse(status=SERVING)
        if request.service in READINESS_NAMES:
            return health_pb2.HealthCheckResponse(status=SERVING if self.ready() else NOT_SERVING)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)

    async def Watch(self, request, context):  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch is not served on the health port; use Check")


class ExtProcHealth:
    """The ext_proc port's standard health servicer, kept in step with readiness."""

    def __init__(self):
        self.servicer = health.aio.HealthServicer()
        self._status: int | None = None

    async def set_ready(self, ready: bool) -> None:
        status = SERVING if ready else NOT_SERVING
        if status != self._status:
            self._status = status
            for name in ("", EXT_PROC_SERVICE):
                await self.servicer.set(name, status)
