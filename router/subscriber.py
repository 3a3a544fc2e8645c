"""One worker's KvEvents stream into the index (DESIGN section 4).

The stream starts with a snapshot (a router builds its index from the workers
alone), then carries live events numbered 1, 2, ... per worker instance.
`apply()` is the pure part: it applies a batch and reports `Applied`,
`GapDetected(expected, received)` or `Restarted` (the worker's instance id
changed). `run()` is the connection loop: on a gap or restart it asks for a
fresh snapshot; when the stream breaks it reconnects with capped exponential
backoff and asks for the events after the last sequence number it applied
(the worker answers with a snapshot when those are gone).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from splitserve.proto.v1 import worker_pb2

from splitserve.router.index import CLEARED, REMOVED, STORED, KvIndex

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class Applied:
    num_events: int


@dataclass(slots=True, frozen=True)
class GapDetected:
    expected: int
    received: int


@dataclass(slots=True, frozen=True)
class Restarted:
    old_instance: str
    new_instance: str


Outcome = Applied | GapDetected | Restarted


class EventSubscriber:
    def __init__(self, worker_id: str, index: KvIndex, initial_backoff_s: float = 0.05,
                 max_backoff_s: float = 2.0):
        self.worker_id = worker_id
        self.index = index
        self.last_seq = 0
        self.instance_id: str | None = None
        self.synced = False            # a snapshot has been applied for this instance
        self.num_resyncs = 0
        self.num_events = 0
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s

    # -- pure ----------------------------------------------------------------------
    def apply(self, batch: worker_pb2.KvEventBatch) -> Outcome:
        if batch.snapshot:
            self.index.clear_worker(self.worker_id)
            self._apply_events(batch.events)
            self.last_seq, self.instance_id, self.synced = batch.last_seq, batch.instance_id, True
            return Applied(len(batch.events))
        if self.instance_id is not None and batch.instance_id != self.instance_id:
            return Restarted(self.instance_id, batch.instance_id)
        if not self.synced:
            return GapDetected(self.last_seq + 1, batch.events[0].seq if batch.events else batch.last_seq)
        expected = self.last_seq + 1
        events = batch.events
        seqs = [ev.seq for ev in events]
        if seqs != list(range(expected, expected + len(seqs))):
            i = next(i for i, s in enumerate(seqs) if s != expected + i)
            self._apply_events(events[:i])
            self.last_seq = expected + i - 1
            return GapDetected(expected + i, seqs[i])
        self._apply_events(events)
        self.last_seq = max(self.last_seq, batch.last_seq)
        return Applied(len(events))

    def _apply_events(self, events) -> None:
        """Protobuf events -> (kind, hashes) pairs, applied to the index in order: device events in
        runs of one call each, a lower tier's (host, disk) one by one between them."""
        ops = []
        for ev in events:
            kind, hashes = (STORED, ev.stored.block_hashes) if ev.HasField("stored") else _op(ev)
            tier = _tier(ev)
            if tier in ("", "device"):
                ops.append((kind, hashes))
                continue
            if ops:
                self.index.apply(self.worker_id, ops)
                ops = []
            self.index.apply_tier(self.worker_id, tier, kind, hashes)
        if ops:
            self.index.apply(self.worker_id, ops)
        self.num_events += len(events)

    # -- the connection loop -------------------------------------------------------
    async def run(self, stub) -> None:
        """Until cancelled. `stub` is a worker_pb2_grpc.WorkerStub."""
        backoff = self.initial_backoff_s
        want_snapshot = True
        while True:
            call = stub.KvEvents(worker_pb2.KvEventsRequest(since_seq=self.last_seq, snapshot=want_snapshot))
            want_snapshot = False
            try:
                async for batch in call:
                    outcome = self.apply(batch)
                    backoff = self.initial_backoff_s
                    if not isinstance(outcome, Applied):
                        log.info("kv events of %s: %s; resyncing from a snapshot", self.worker_id, outcome)
                        self.num_resyncs += 1
                        self.synced = False
                        want_snapshot = True
                        break
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                log.debug("kv events of %s: %s; reconnecting in %.2f s", self.worker_id, exc.code().name, backoff)
            finally:
                call.cancel()
            if not want_snapshot:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)


def _op(ev: worker_pb2.KvEvent) -> tuple[int, object]:
    if ev.HasField("stored"):
        return STORED, ev.stored.block_hashes
    if ev.HasField("removed"):
        return REMOVED, ev.removed.block_hashes
    if ev.HasField("cleared"):
        return CLEARED, ()
    return 0, ()                          # an event kind newer than this router: skipped


def _tier(ev: worker_pb2.KvEvent) -> str:
    if ev.HasField("stored"):
        return ev.stored.tier
    if ev.HasField("removed"):
        return ev.removed.tier
    return ""
