"""Why flow control refuses a request: `Shed`, a 429 with llm-d's dropped-reason value.

A shed request never took capacity, so it cost no worker time. Each `ShedCause` maps to the
value llm-d's EPP sends in `x-llm-d-request-dropped-reason` (llm-d-router,
pkg/common/error: `rejected-saturated` when a queue is at capacity, `rejected-ttl-expired` when a
request's time in the queue ran out). llm-d has no value for a TTFT deadline judged unmeetable at
arrival; that is a capacity refusal, so it is `rejected-saturated`. The cause itself, finer than
the header, is the `cause` label of the shed counter (metrics.py).
"""

from __future__ import annotations

import enum

from splitserve.errors import RecoverableError

DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
REJECTED_SATURATED = "rejected-saturated"
REJECTED_TTL_EXPIRED = "rejected-ttl-expired"
HTTP_STATUS = 429


class ShedCause(enum.Enum):
    QUEUE_FULL = "queue_full"                     # the band was full and the newcomer's flow holds the most
    DISPLACED = "displaced"                       # queued, then pushed out of a full band: its flow held the most
    DEADLINE_UNMEETABLE = "deadline_unmeetable"   # its estimated wait was over its TTFT deadline on arrival
    DEADLINE_PASSED = "deadline_passed"           # still queued at its TTFT deadline
    MAX_WAIT = "max_wait"                         # still queued after the band's max_wait_s

    @property
    def dropped_reason(self) -> str:
        """The `x-llm-d-request-dropped-reason` value, as llm-d spells it."""
        if self in (ShedCause.DEADLINE_PASSED, ShedCause.MAX_WAIT):
            return REJECTED_TTL_EXPIRED
        return REJECTED_SATURATED


class Shed(RecoverableError):
    """A request flow control refused: answer 429 with `reason` in `x-llm-d-request-dropped-reason`
    and `retry_after_s` in Retry-After. `str()` is fit for the client."""

    def __init__(self, cause: ShedCause, band: int, retry_after_s: int, message: str) -> None:
        super().__init__(message)
        self.cause = cause
        self.band = band
        self.retry_after_s = retry_after_s

    @property
    def reason(self) -> str:
        return self.cause.dropped_reason

    def __repr__(self) -> str:
        return f"Shed({self.cause.name}, band={self.band}, retry_after_s={self.retry_after_s}, {str(self)!r})"
