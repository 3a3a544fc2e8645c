"""Discovery inside Ray: a directory deployment with leases, and the registry the router reads.

Ray has no etcd, but the same model fits (DESIGN section 4): every worker
replica renews a lease on its `DirectoryEntry` every `LEASE_RENEW_S` in the
`WorkerDirectory` deployment, which is part of the same Serve application
and reached through the Serve handle graph (no detached actors to clean up);
an entry not renewed for `LEASE_TTL_S` is dropped, so a worker whose actor
was killed leaves routing within seconds, and one shut down gracefully
releases its lease at once. The directory restarts empty if its replica dies;
the workers' next renewals refill it within a second.

`DirectoryRegistry` is the registry interface the frontend's worker pool
already reconciles its members against (`members()`, `changed`, `start()`,
`close()`, as splitserve/discovery/static.py and etcd.py): it polls the directory
every `POLL_S` from the ingress replica's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from splitserve.discovery import WorkerRecord

log = logging.getLogger(__name__)

LEASE_RENEW_S = 1.0
LEASE_TTL_S = 4.0
POLL_S = 0.5


@dataclass(slots=True, frozen=True)
class DirectoryEntry:
    worker_id: str
    role: str               # prefill | decode | both
    address: str            # host:port of the worker's gRPC service
    actor_name: str         # the replica's Ray actor, in namespace "serve" (tests kill it)
    pid: int

    def record(self) -> WorkerRecord:
        return WorkerRecord(self.worker_id, self.role, self.address)


class WorkerDirectory:
    """The Serve deployment class: worker id -> (entry, lease deadline)."""

    def __init__(self, ttl_s: float = LEASE_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[str, tuple[DirectoryEntry, float]] = {}

    def renew(self, entry: DirectoryEntry) -> None:
        if entry.worker_id not in self._entries:
            log.info("directory: worker %s (%s) at %s registered", entry.worker_id, entry.role, entry.address)
        self._entries[entry.worker_id] = (entry, time.monotonic() + self.ttl_s)

    def release(self, worker_id: str) -> None:
        if self._entries.pop(worker_id, None) is not None:
            log.info("directory: worker %s released its lease", worker_id)

    def members(self) -> list[DirectoryEntry]:
        now = time.monotonic()
        for worker_id in [w for w, (_, deadline) in self._entries.items() if deadline < now]:
            log.info("directory: worker %s lease expired", worker_id)
            del self._entries[worker_id]
        return [entry for entry, _ in self._entries.values()]


class DirectoryRegistry:
    """The worker pool's registry, fed from a `WorkerDirectory` deployment handle."""

    def __init__(self, directory, poll_s: float = POLL_S) -> None:
        self.directory = directory
        self.poll_s = poll_s
        self.changed = asyncio.Event()
        self._members: dict[str, WorkerRecord] = {}
        self._task: asyncio.Task | None = None

    def members(self) -> dict[str, WorkerRecord]:
        return dict(self._members)

    async def refresh(self) -> None:
        entries = await self.directory.members.remote()
        members = {e.worker_id: e.record() for e in entries}
        if members != self._members:
            self._members = members
            self.changed.set()

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._poll(), name="ray directory poll")

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.refresh()
            except Exception as exc:  # noqa: BLE001 - keep the last members, like etcd's registry
                log.warning("directory poll failed (keeping %d workers): %r", len(self._members), exc)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
