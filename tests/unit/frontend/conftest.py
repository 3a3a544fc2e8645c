"""Shared by the HTTP and gRPC guard tests: a Guard whose refusals land in a counter of its own."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

from splitserve.services.frontend.auth import ApiKeys
from splitserve.services.frontend.guard import Guard
from splitserve.services.frontend.limits import LimitsConfig


def counted_guard(keys: tuple[str, ...] = (), clock: Callable[[], float] = time.monotonic,
                  **limits) -> tuple[Guard, Callable[[str, str], float]]:
    """A Guard with `keys` (none: open), `limits` (LimitsConfig fields) and its rate limiter on
    `clock`, and `rejected(protocol, reason)`: how many requests it refused for that reason."""
    registry = CollectorRegistry()
    counter = Counter("rejected", "refusals", ["protocol", "reason"], registry=registry)
    guard = Guard(ApiKeys.load(list(keys), environ={}), LimitsConfig(**limits), counter, clock)

    def rejected(protocol: str, reason: str) -> float:
        return registry.get_sample_value("rejected_total", {"protocol": protocol, "reason": reason}) or 0.0

    return guard, rejected
