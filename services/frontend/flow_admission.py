"""Flow control in front of routing (issue 40, `--flow-control`): services/flow_control's
`FlowController` over the frontend's workers, so that a request the workers have no room for
waits in its priority band, or is shed with a 429 before any worker sees it.

What the frontend decides around the library:

- Room (`WorkerSlots`): at most `max_concurrency` requests dispatched per ready decode-capable
  worker (role both or decode), counted over the pool as it is now; fair sharing
  (services/flow_control/fair_share.py) may dispatch a lighter tenant's request up to `burst`
  units beyond it while a flooding tenant holds units, which the worker runs in its batch (or
  queues, when the room is its whole batch: first in line, since the flood waits for room). A
  worker that turns ready (first, or again) wakes the controller; one that leaves lowers the
  room, and requests running keep their place. One unit per API request, held from dispatch until
  its response has been sent or the request ended otherwise (error, client gone, timeout; a
  migration keeps it). The worker
  has a running batch of `--max-num-seqs`; dispatching more than that only moves the queue into
  the worker, where it is served in arrival order: `serve --flow-control` defaults
  `--max-concurrency` to that batch, shared among its frontends.
- Bands (`FlowControlSettings.band_of`): a request's `priority` (vLLM's: lower goes first) is
  served by the band with the greatest value not above it, or by the lowest band when it is below
  them all: every integer has a band, and a lower value never lands in a later band.
- The 429 (`shed_error`): an OpenAI-style body (type `rate_limit_error`, code llm-d's dropped
  reason), the `x-llm-d-request-dropped-reason` header and `Retry-After`.

What a request says (flow, priority, TTFT deadline) is read in flow_headers.py.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from splitserve.services.flow_control import (DROPPED_REASON_HEADER, BandConfig, FlowControlConfig, FlowControlMetrics,
                                              FlowController, FlowRequest, Shed, Ticket)
from splitserve.services.flow_control.config import DEFAULT_BURST

from splitserve.services.frontend.errors import APIError
from splitserve.services.frontend.workers.pool import WorkerHandle, WorkerPool

DEFAULT_MAX_CONCURRENCY = 64      # the workers' default --max-num-seqs
DEFAULT_MAX_QUEUE = 256           # per band
DEFAULT_MAX_WAIT_S = 30.0
DEFAULT_BAND_PRIORITIES = (-1, 0, 1)   # negative: before the default; 0; positive: after it


@dataclass(slots=True, frozen=True)
class FlowControlSettings:
    """`--flow-control`'s bands and room; checked when built (ValueError names what cannot work)."""

    bands: tuple[BandConfig, ...] = tuple(BandConfig(p, DEFAULT_MAX_QUEUE, DEFAULT_MAX_WAIT_S)
                                          for p in DEFAULT_BAND_PRIORITIES)
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY     # per ready decode-capable worker
    fair_share: bool = True                            # --no-fair-share: plain round-robin
    burst: int = DEFAULT_BURST                         # --fair-share-burst

    def __post_init__(self) -> None:
        object.__setattr__(self, "bands", tuple(sorted(self.bands, key=lambda b: b.priority)))
        if isinstance(self.max_concurrency, bool) or not isinstance(self.max_concurrency, int) \
                or self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be an integer >= 1, not {self.max_concurrency!r}")
        self.config()

    def config(self) -> FlowControlConfig:
        """The library's config; its default band (for no priority at all) is priority 0's."""
        if not self.bands:
            raise ValueError("flow control needs at least one --priority-band")
        return FlowControlConfig(self.bands, default_priority=self.band_of(0), fair_share=self.fair_share,
                                 burst=self.burst)

    def describe(self) -> str:
        """One start-up line."""
        bands = "; ".join(f"{b.priority} (queue {b.max_queue}, wait {b.max_wait_s:g} s"
                          + (f", share {b.min_share:g})" if b.min_share else ")") for b in self.bands)
        fairness = f"fair shares (burst {self.burst})" if self.fair_share else "round-robin"
        return (f"flow control on: {self.max_concurrency} requests per decode-capable worker; priority bands {bands}; "
                f"between tenants {fairness}")

    def band_of(self, priority: int) -> int:
        """The band serving `priority`: the greatest band value not above it, else the lowest band."""
        values = [b.priority for b in self.bands]
        return values[max(bisect.bisect_right(values, priority) - 1, 0)]


@dataclass(slots=True)
class WorkerSlots:
    """The Capacity flow control dispatches into: `per_worker` requests per ready decode-capable
    worker (`num_workers()` now)."""

    per_worker: int
    num_workers: Callable[[], int]
    num_in_flight: int = 0

    def has_room(self) -> bool:
        return self.num_in_flight < self.units()

    def units(self) -> int:
        """All the room there is now: what fair sharing divides between the active flows."""
        return self.per_worker * self.num_workers()

    def take(self, beyond_room: bool = False) -> None:
        """Book a unit; beyond the room only for fair sharing's burst (the controller bounds it)."""
        self.num_in_flight += 1

    def give_back(self) -> None:
        if self.num_in_flight == 0:
            raise RuntimeError("give_back() with nothing in flight")
        self.num_in_flight -= 1


class FrontendFlowControl:
    """The frontend's flow controller: `admit` before routing, release the Ticket when the request ends."""

    def __init__(self, settings: FlowControlSettings, pool: WorkerPool, registry: CollectorRegistry) -> None:
        self.settings = settings
        self.slots = WorkerSlots(settings.max_concurrency, lambda: len(pool.ready("decode")))
        self.controller = FlowController(settings.config(), self.slots, metrics=FlowControlMetrics(registry))
        pool.subscribe(_WakeOnReady(self.controller))

    async def admit(self, request: FlowRequest) -> Ticket:
        """A Ticket once `request` (its priority as the client sent it) may be routed; raises the
        429 APIError when it is shed. Cancelling the wait (the client went away) leaves the queue."""
        band = self.settings.band_of(request.priority)
        try:
            return await self.controller.admit(FlowRequest(request.flow_id, band, request.ttft_deadline_s,
                                                           request.request_id))
        except Shed as shed:       # logged by the controller (debug): a flood sheds thousands a second
            raise shed_error(shed) from None

    def num_queued(self) -> int:
        """Requests waiting for room (0 when idle: a leak check)."""
        return self.controller.num_queued()


def shed_error(shed: Shed) -> APIError:
    """The 429 for a shed request: OpenAI's error body, llm-d's dropped reason, Retry-After."""
    return APIError(429, str(shed), type="rate_limit_error", code=shed.reason,
                    headers={DROPPED_REASON_HEADER: shed.reason, "retry-after": str(shed.retry_after_s)})


class _WakeOnReady:
    """A pool listener: a worker that turns ready brings room, so queued requests may go."""

    def __init__(self, controller: FlowController) -> None:
        self._controller = controller

    def worker_added(self, worker: WorkerHandle) -> None:
        pass

    def worker_described(self, worker: WorkerHandle) -> None:
        # The pool marks a worker ready before it tells its listeners (WorkerPool._watch).
        self._controller.wake()

    def worker_removed(self, worker: WorkerHandle) -> None:
        pass
