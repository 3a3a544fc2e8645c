"""What a worker replica asks its worker over the worker's own gRPC API: serving, drain, load.

The same for a worker on a thread of the replica (worker.py) and one in a child process
(worker_process.py): both are `splitserve worker` servers at an address.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import grpc

from splitserve.errors import SplitserveError
from splitserve.services.launch.probes import worker_serving

log = logging.getLogger(__name__)


def wait_serving(address: str, name: str, alive: Callable[[], bool], why_not: Callable[[], str],
                 timeout: float) -> None:
    """Until the worker's gRPC health says SERVING; raises when it stops or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not worker_serving(address):
        if not alive():
            raise SplitserveError(f"worker {name} exited while starting: {why_not()}")
        if time.monotonic() > deadline:
            raise SplitserveError(f"worker {name} not serving after {timeout:.0f} s")
        time.sleep(0.1)


def drain(address: str, name: str, timeout: float) -> int:
    """Refuse new work (the routers see NOT_SERVING) and wait up to `timeout` for the calls in
    flight to end; returns how many were still running (-1: the worker did not answer)."""
    from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        try:
            left = stub.Drain(worker_pb2.DrainRequest(), timeout=5).num_in_flight
            while left and time.monotonic() < deadline:
                time.sleep(0.2)
                left = stub.Stats(worker_pb2.StatsRequest(), timeout=5).num_in_flight
        except grpc.RpcError as exc:
            log.warning("worker %s: drain failed: %s", name, exc.code().name)
            return -1
    return left


def num_in_flight(address: str) -> int:
    from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=5).num_in_flight
