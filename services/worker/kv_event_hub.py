"""Per-worker KV event log with a bounded replay buffer and a snapshot (DESIGN section 4).

The engine numbers its events (1, 2, ...) and hands each batch to `publish`
on the engine thread. The hub keeps the newest `capacity` events for replay
and a mirror of the currently cached blocks for snapshots. A subscriber asks
for the events after the last sequence number it saw; when those have fallen
out of the buffer (or it asks for one) it gets a snapshot instead: every
cached block as a BlockStored, as of a sequence number, then live events.
A subscriber that falls behind by more than the buffer while connected is
resynchronised the same way.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from splitserve.services.engine_api.kv_events import AllCleared, BlockRemoved, BlockStored, KVEvent


@dataclass(slots=True, frozen=True)
class EventBatch:
    """What one KvEvents message carries. Snapshot events have seq 0."""

    snapshot: bool
    last_seq: int
    events: list[KVEvent] = field(default_factory=list)


class KvEventHub:
    def __init__(self, capacity: int = 10_000):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._lock = threading.Lock()
        self._buffer: deque[KVEvent] = deque(maxlen=capacity)
        self._cached: dict[bytes, BlockStored] = {}     # block hash -> how it was stored
        self._last_seq = 0
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    @property
    def last_seq(self) -> int:
        return self._last_seq

    # -- the engine thread -------------------------------------------------------
    def publish(self, events: list[KVEvent]) -> None:
        with self._lock:
            for event in events:
                self._buffer.append(event)
                self._apply(event)
                self._last_seq = event.seq
            waiters = list(self._waiters)
        for loop, wake in waiters:
            loop.call_soon_threadsafe(wake.set)

    def _apply(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            for i, h in enumerate(event.block_hashes):
                parent = event.parent_hash if i == 0 else event.block_hashes[i - 1]
                bs = len(event.token_ids) // max(1, len(event.block_hashes))
                self._cached[h] = BlockStored(0, (h,), parent, event.token_ids[i * bs:(i + 1) * bs],
                                              event.tier)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self._cached.pop(h, None)
        elif isinstance(event, AllCleared):
            self._cached.clear()

    # -- readers -----------------------------------------------------------------
    def read(self, since_seq: int, snapshot: bool = False) -> EventBatch:
        """Events after `since_seq`, or a snapshot when asked or when they are gone."""
        with self._lock:
            oldest = self._buffer[0].seq if self._buffer else self._last_seq + 1
            replayable = oldest - 1 <= since_seq <= self._last_seq
            if snapshot or not replayable:
                return EventBatch(True, self._last_seq, list(self._cached.values()))
            skip = since_seq - (oldest - 1)
            events = [self._buffer[i] for i in range(skip, len(self._buffer))]
            return EventBatch(False, self._last_seq, events)

    async def subscribe(self, since_seq: int, snapshot: bool = False) -> AsyncIterator[EventBatch]:
        """The first batch always comes at once (possibly empty); then one per published batch."""
        wake = asyncio.Event()
        waiter = (asyncio.get_running_loop(), wake)
        with self._lock:
            self._waiters.add(waiter)
        try:
            batch = self.read(since_seq, snapshot)
            yield batch
            cursor = batch.last_seq
            while True:
                await wake.wait()
                wake.clear()
                batch = self.read(cursor)
                if batch.events or batch.snapshot:
                    yield batch
                cursor = batch.last_seq
        finally:
            with self._lock:
                self._waiters.discard(waiter)
