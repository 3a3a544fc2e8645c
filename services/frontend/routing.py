"""Which workers serve a request: the `Router` interface and round-robin.

A router picks a decode-capable worker (role decode or both) and, when the
deployment has a prefill pool, a prefill worker; the decode worker decides by
itself whether the prompt is worth sending there (conditional disaggregation).
The KV-aware router (splitserve.router, a later issue) implements the same
interface and also uses the lifecycle hooks; round-robin ignores them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from splitserve.services.frontend.workers.pool import WorkerHandle, WorkerPool


@dataclass(slots=True, frozen=True)
class RouteRequest:
    request_id: str
    token_ids: list[int]


@dataclass(slots=True, frozen=True)
class Route:
    decode: WorkerHandle
    prefill: WorkerHandle | None
    reason: object          # str() says why: formatted only when it is logged


class Router(Protocol):
    def route(self, request: RouteRequest, exclude: frozenset[str] = frozenset()) -> Route | None:
        """Pick workers for `request`, avoiding worker ids in `exclude`; None when no
        decode-capable worker is ready."""

    def on_first_token(self, request_id: str) -> None:
        """The request's prefill is over (load accounting)."""

    def on_finished(self, request_id: str) -> None:
        """The request ended, however it ended."""


class RoundRobinRouter:
    """Each leg cycles through its ready workers in order."""

    def __init__(self, pool: WorkerPool):
        self.pool = pool
        self._next_decode = 0
        self._next_prefill = 0

    def route(self, request: RouteRequest, exclude: frozenset[str] = frozenset()) -> Route | None:
        decoders = [w for w in self.pool.ready("decode") if w.worker_id not in exclude]
        if not decoders:
            return None
        decode = decoders[self._next_decode % len(decoders)]
        self._next_decode += 1
        prefillers = [w for w in self.pool.ready("prefill") if w.worker_id not in exclude]
        prefill = None
        if prefillers:
            prefill = prefillers[self._next_prefill % len(prefillers)]
            self._next_prefill += 1
        return Route(decode, prefill, "round-robin")

    def on_first_token(self, request_id: str) -> None:
        pass

    def on_finished(self, request_id: str) -> None:
        pass
