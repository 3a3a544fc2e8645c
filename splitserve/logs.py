"""Warnings that repeat without end, kept to one line each and one line per interval.

Background loops (the router's Stats poller, health and event watches) meet the
same failure on every pass while a worker is busy or gone: a Stats call that times
out while the worker computes a long prefill fails every 0.5 s. Logged as they come,
with the exception's repr, each is a multi-line gRPC dump (`debug_error_string`)
several times a second, and the one line that matters scrolls away.

- `one_line_error(exc)` says what failed in one line: a gRPC error as its status
  code and details (never its debug string), anything else as type and message.
- `RateLimitedLog` logs a message for a key (e.g. worker and what failed) at most
  once per `interval_s` on an injectable clock; the next line it lets through says
  how many were suppressed meanwhile, so nothing is hidden, only counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

DEFAULT_INTERVAL_S = 30.0


def one_line_error(exc: BaseException) -> str:
    """`CODE: details` for a gRPC error (grpc.aio.AioRpcError and look-alikes), else `Type: message`."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if callable(code) and callable(details):
        name, said = getattr(code(), "name", code()), details()
        text = f"{name}: {said}" if said else str(name)
    else:
        message = str(exc)
        text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return " ".join(text.split())        # newlines and runs of spaces folded: one line


@dataclass(slots=True)
class _Seen:
    last_logged_s: float
    suppressed: int = 0


@dataclass(slots=True)
class RateLimitedLog:
    """Logs each key's message at most once per `interval_s`, counting what it holds back."""

    logger: logging.Logger
    interval_s: float = DEFAULT_INTERVAL_S
    clock: Callable[[], float] = time.monotonic
    _seen: dict[Hashable, _Seen] = field(default_factory=dict)

    def log(self, level: int, key: Hashable, msg: str, *args: object) -> bool:
        """Log `msg % args` unless `key` logged less than `interval_s` ago; True when logged."""
        now = self.clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen.last_logged_s < self.interval_s:
            seen.suppressed += 1
            return False
        if seen is not None and seen.suppressed:
            msg += " (%d more like this in the last %.0f s)"
            args = (*args, seen.suppressed, now - seen.last_logged_s)
        self._seen[key] = _Seen(now)
        self.logger.log(level, msg, *args)
        return True

    def warning(self, key: Hashable, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args)

    def forget(self, match: Callable[[Hashable], bool]) -> None:
        """Drop the keys `match` accepts (e.g. a removed worker's), so memory follows membership."""
        for key in [k for k in self._seen if match(k)]:
            del self._seen[key]

    def suppressed(self, key: Hashable) -> int:
        """How many of `key`'s messages were held back since it last logged."""
        seen = self._seen.get(key)
        return seen.suppressed if seen is not None else 0
