"""A clock that moves only when a test moves it, for code that takes a `clock` argument.

Code that waits on time (a limiter's token bucket, a load model dropping stale
requests, a reservation's deadline) reads `clock()` instead of time.monotonic
directly, so that its unit tests step time forward (`advance`) instead of
sleeping: fast, and never flaky on a loaded machine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class FakeClock:
    """Seconds that only `advance` (or assigning `now`) changes."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
