"""A worker's SIGTERM drain (services/worker/shutdown.py): it leaves only once no call runs and no
finished prefill's KV is still held for its decode worker to take, or at its timeout."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from splitserve.proto.v1 import worker_pb2
from splitserve.services.worker import shutdown


@dataclass
class _Service:
    """The parts of a WorkerService the drain reads: in-flight calls, and Stats' held prefills,
    which a decode worker's pull lowers over time."""

    held: list[int]                      # num_held_prefills answered by each read_stats, the last repeated
    suspended: list[int] = field(default_factory=lambda: [0])   # num_suspended_held, likewise
    draining: bool = False
    counters: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(num_in_flight=0))
    options: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(worker_id="p0"))
    loop: object = None
    reads: int = 0

    async def start_draining(self) -> None:
        self.draining = True

    async def read_stats(self, timeout_s: float) -> worker_pb2.StatsResponse:
        held = self.held[min(self.reads, len(self.held) - 1)]
        suspended = self.suspended[min(self.reads, len(self.suspended) - 1)]
        self.reads += 1
        return worker_pb2.StatsResponse(worker_id="p0", num_held_prefills=held, num_suspended_held=suspended)


class _Registration:
    def __init__(self, service: _Service):
        self.service, self.closed_with_held = service, None

    async def close(self) -> None:
        self.closed_with_held = self.service.held[min(self.service.reads, len(self.service.held)) - 1]


def test_a_prefill_worker_leaves_only_once_its_held_kv_was_taken():
    service = _Service(held=[2, 2, 1, 1, 0])
    registration = _Registration(service)
    result = asyncio.run(shutdown.drain(service, timeout_s=30.0, registration=registration))
    assert service.draining and result.num_left == 0
    assert service.reads >= 5 and registration.closed_with_held == 0     # deregistered after the last pull


def test_the_drain_timeout_bounds_the_wait_for_held_kv(caplog):
    service = _Service(held=[3])                 # a decode worker that never pulls
    start = time.monotonic()
    result = asyncio.run(shutdown.drain(service, timeout_s=0.3))
    assert 0.3 <= time.monotonic() - start < 5 and result.num_left == 0
    assert "3 prefills' KV not yet taken by their decode workers after the 0.3 s drain timeout" in caplog.text


def test_a_decode_worker_leaves_only_once_the_kv_of_the_requests_it_suspended_was_read(caplog):
    """Frontends move a draining decode worker's requests away with their KV: it suspends them, and
    the decode workers taking them over read the KV afterwards; leaving before would make them
    recompute it."""
    service = _Service(held=[0], suspended=[3, 2, 0])
    result = asyncio.run(shutdown.drain(service, timeout_s=30.0))
    assert result.num_left == 0 and service.reads >= 3
    service = _Service(held=[0], suspended=[2])           # never read: the drain timeout bounds the wait
    asyncio.run(shutdown.drain(service, timeout_s=0.3))
    assert "2 suspended requests' KV not yet read by the decode workers taking them over after the 0.3 s" \
        in caplog.text
