"""The operator's side of the drain protocol: talk to a group's rank-0 worker.

`Drain` makes the worker refuse new requests (its gRPC health turns
NOT_SERVING, so routers and frontends stop sending it work); `Stats` reports
`num_in_flight` (Generate and Prefill calls still being served). The operator
deletes the group when that reaches zero or the spec's drain timeout passes.
Kubernetes gives the pod's IP; the `splitserve.io/worker-address` annotation
overrides it (tests point it at a real worker process, as kwok runs no containers).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from splitserve.operator import names
from splitserve.operator.groups import PodState
from splitserve.tls import TlsConfig

log = logging.getLogger(__name__)
RPC_TIMEOUT_S = 3.0


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    num_in_flight: int
    num_running: int
    num_waiting: int

    @property
    def idle(self) -> bool:
        return self.num_in_flight == 0 and self.num_running == 0 and self.num_waiting == 0


def worker_address(pod: PodState, use_pod_ip: bool = True) -> str | None:
    """The annotation's address, else podIP:WORKER_PORT (unless `use_pod_ip` is off: tests
    on simulated nodes, whose pod IPs are fake and must never be dialled)."""
    override = pod.annotations.get(names.ANN_WORKER_ADDRESS)
    if override:
        return override
    return f"{pod.pod_ip}:{names.WORKER_PORT}" if pod.pod_ip and use_pod_ip else None


async def drain_and_measure(address: str) -> WorkerLoad | None:
    """Ask the worker to drain (idempotent) and return its load; None when unreachable."""
    from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc

    try:
        async with TlsConfig.client_from_env().aio_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            await stub.Drain(worker_pb2.DrainRequest(), timeout=RPC_TIMEOUT_S)
            stats = await stub.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        log.info("worker at %s unreachable while draining: %s", address, exc.code().name)
        return None
    return WorkerLoad(num_in_flight=stats.num_in_flight, num_running=stats.num_running,
                      num_waiting=stats.num_waiting)
