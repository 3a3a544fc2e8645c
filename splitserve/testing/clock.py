"""A clock that moves only when a test moves it, for code that takes a `clock` (and `sleep`) argument.

Code that waits on time (a limiter's token bucket, a load model dropping stale
requests, a reservation's deadline, a write fence waiting out a grant) reads
`clock()` instead of time.monotonic directly, and awaits `sleep` instead of
asyncio.sleep, so that its unit tests step time forward (`advance`) instead of
sleeping: fast, and never flaky on a loaded machine.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass(slots=True)
class FakeClock:
    """Seconds that only `advance` (or assigning `now`) changes.

    `sleep(s)` waits until the clock has moved `s` past the moment it was called; with
    `auto_advance` it moves the clock itself instead (for waits a test need not watch)."""

    now: float = 0.0
    auto_advance: bool = False
    slept: list[float] = field(default_factory=list)
    _sleepers: list[tuple[float, asyncio.Future]] = field(default_factory=list)

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        if self.auto_advance or seconds <= 0:
            self.now += max(0.0, seconds)
            return
        future = asyncio.get_running_loop().create_future()
        self._sleepers.append((self.now + seconds, future))
        await future

    def advance(self, seconds: float) -> None:
        self.now += seconds
        due = [(end, f) for end, f in self._sleepers if end <= self.now]
        for entry in due:
            self._sleepers.remove(entry)
            if not entry[1].done():
                entry[1].set_result(None)

    @property
    def num_sleeping(self) -> int:
        return len(self._sleepers)
