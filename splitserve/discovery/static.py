"""The static registry `splitserve serve` uses: the launcher names every worker up front."""

from __future__ import annotations

import asyncio

from splitserve.discovery import WorkerRecord


class StaticRegistry:
    def __init__(self, records: list[WorkerRecord]):
        self._members = {r.worker_id: r for r in records}
        self.changed = asyncio.Event()

    def members(self) -> dict[str, WorkerRecord]:
        return dict(self._members)

    def add(self, record: WorkerRecord) -> None:
        self._members[record.worker_id] = record
        self.changed.set()

    def remove(self, worker_id: str) -> None:
        if self._members.pop(worker_id, None) is not None:
            self.changed.set()

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass
