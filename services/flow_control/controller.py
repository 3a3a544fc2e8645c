"""`FlowController`: admit a request now, queue it by band and flow, or shed it with a 429.

`admit(request)` returns a `Ticket` once the request may run; the ticket holds one unit of
capacity (capacity.py) until it is released, which dispatches the next queued request. With
room and nothing queued, admit books the unit and returns without queueing. Otherwise the
request waits in its band (queues.py) until the dispatch order reaches it — the band by
dispatch_order.py, the flow within it by fair_share.py (or round-robin with fair sharing off) —
or is shed (shedding.py):

- on arrival, when its TTFT deadline is shorter than its estimated wait (wait_estimate.py);
- on arrival, when its band is full: the newest request of the flow holding the most is shed,
  which is the newcomer when that is its own flow;
- while queued, at its TTFT deadline or after the band's max_wait_s (a timer on the injected
  `sleep` and `clock`).

A shed request never took capacity. A cancelled admit (the client went away) leaves its queue
and gives back only what it took: the unit of a ticket that was handed to it as it was cancelled.
Everything runs on the event loop's thread; nothing here blocks or sleeps on real time when the
clock and sleep are a test's.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from splitserve.services.flow_control.capacity import Capacity, SizedCapacity
from splitserve.services.flow_control.config import BandConfig, FlowControlConfig
from splitserve.services.flow_control.dispatch_order import ShareWindow, pick_band
from splitserve.services.flow_control.fair_share import FlowLedger, Pick, pick_flow
from splitserve.services.flow_control.metrics import FlowControlMetrics
from splitserve.services.flow_control.queues import BandQueue, QueuedRequest
from splitserve.services.flow_control.requests import FlowRequest
from splitserve.services.flow_control.shedding import Shed, ShedCause
from splitserve.services.flow_control.wait_estimate import DispatchInterval

log = logging.getLogger(__name__)


class Ticket:
    """The right to run one dispatched request: holds a unit of capacity until `release()`.

    Release exactly once when the request ends (a second call does nothing); `with ticket:`
    releases on the way out."""

    __slots__ = ("request", "band", "waited_s", "_on_release", "_released")

    def __init__(self, request: FlowRequest, band: int, waited_s: float, on_release: Callable[[], None]) -> None:
        self.request = request
        self.band = band
        self.waited_s = waited_s
        self._on_release = on_release
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._on_release()

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


@dataclass(slots=True)
class _Band:
    config: BandConfig
    queue: BandQueue
    interval: DispatchInterval
    flows: FlowLedger


class FlowController:
    """Admission by priority band and flow over one `Capacity`; see the module docstring."""

    def __init__(self, config: FlowControlConfig, capacity: Capacity, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 metrics: FlowControlMetrics | None = None) -> None:
        self._capacity = capacity
        self._sized = capacity if isinstance(capacity, SizedCapacity) else None
        self._clock = clock
        self._sleep = sleep
        self._metrics = metrics
        self._fair_share, self._burst = config.fair_share, config.burst
        self._bands = {b.priority: _Band(b, BandQueue(), DispatchInterval(config.interval_smoothing), FlowLedger())
                       for b in config.bands}
        self._default_band = self._bands[config.default_priority]
        self._shares = ShareWindow(config.share_window)
        self._num_queued = 0
        self._num_in_flight = 0        # tickets not yet released
        self._next_seq = 0
        if metrics is not None:
            metrics.watch(self.num_queued_by_flow)

    async def admit(self, request: FlowRequest) -> Ticket:
        """A Ticket once `request` may run; raises Shed when it is refused (it took nothing)."""
        band = self._bands.get(request.priority, self._default_band)
        if not self._fair_share and self._num_queued == 0 and self._capacity.has_room():
            return self._dispatch(band, request, 0.0)
        if (pick := self._goes_at_once(band, request.flow_id)) is not None:
            return self._dispatch(band, request, 0.0, pick.beyond_room)
        entry = self._enqueue(band, request)
        self._dispatch_ready()
        try:
            return await entry.outcome
        except asyncio.CancelledError:
            self._abandon(band, entry)
            raise

    def wake(self) -> None:
        """Dispatch queued requests while the capacity has room: for a caller whose capacity
        frees by other means than a ticket's release (a worker's stats update)."""
        self._dispatch_ready()

    def num_queued(self, priority: int | None = None) -> int:
        """Requests waiting: in the band serving `priority`, or in all bands (0 when idle: a leak check)."""
        if priority is None:
            return self._num_queued
        return len(self._bands.get(priority, self._default_band).queue)

    def num_queued_by_flow(self) -> dict[int, dict[str, int]]:
        """band priority → flow → requests waiting; every band, empty ones too."""
        return {priority: band.queue.num_queued_by_flow() for priority, band in self._bands.items()}

    # -- arrival ---------------------------------------------------------------------------

    def _enqueue(self, band: _Band, request: FlowRequest) -> QueuedRequest:
        """Queue `request` in its band, or raise Shed; a full band may shed another flow's request."""
        now = self._clock()
        seq = self._next_seq
        self._next_seq += 1
        deadline_at = None if request.ttft_deadline_s is None else now + request.ttft_deadline_s
        key = (math.inf if deadline_at is None else deadline_at, seq)
        if request.ttft_deadline_s is not None:
            estimate = band.interval.estimate_wait_s(band.queue.num_ahead(request.flow_id, key))
            if request.ttft_deadline_s <= 0 or (estimate is not None and estimate > request.ttft_deadline_s):
                waiting = ("requests are queued" if estimate is None
                           else f"the estimated wait is {estimate * 1000:.0f} ms")
                raise self._shed(band, request, ShedCause.DEADLINE_UNMEETABLE,
                                 f"its time-to-first-token deadline ({request.ttft_deadline_s * 1000:g} ms) cannot "
                                 f"be met: {waiting} in the priority {band.config.priority} queue")
        if len(band.queue) >= band.config.max_queue:
            self._make_room(band, request)
        entry = QueuedRequest(request, seq, now, deadline_at, asyncio.get_running_loop().create_future())
        if not band.queue:
            band.interval.became_busy(now)
        band.queue.push(entry)
        self._num_queued += 1
        expire_at, cause = now + band.config.max_wait_s, ShedCause.MAX_WAIT
        if deadline_at is not None and deadline_at <= expire_at:
            expire_at, cause = deadline_at, ShedCause.DEADLINE_PASSED
        if math.isfinite(expire_at):
            entry.timer = asyncio.create_task(self._shed_when_due(band, entry, expire_at, cause))
        return entry

    def _make_room(self, band: _Band, request: FlowRequest) -> None:
        """In a full band: shed the newest request of the flow holding the most, or the newcomer."""
        victim = band.queue.displacement_victim(request.flow_id)
        if victim is None:
            raise self._shed(band, request, ShedCause.QUEUE_FULL,
                             f"the priority {band.config.priority} queue is full ({band.config.max_queue} requests) "
                             "and this client holds the most requests in it")
        self._take_out(band, victim)
        self._fail(band, victim, ShedCause.DISPLACED,
                   f"the priority {band.config.priority} queue filled up and this client held the most requests "
                   "in it; its newest was dropped")

    async def _shed_when_due(self, band: _Band, entry: QueuedRequest, expire_at: float, cause: ShedCause) -> None:
        while (left := expire_at - self._clock()) > 0:
            await self._sleep(left)
        entry.timer = None            # this task: leaving the queue must not cancel it
        if self._take_out(band, entry):
            what = ("its time-to-first-token deadline passed" if cause is ShedCause.DEADLINE_PASSED
                    else f"it waited the priority {band.config.priority} queue's limit of {band.config.max_wait_s:g} s")
            self._fail(band, entry, cause, f"{what} before capacity freed up")

    # -- dispatch --------------------------------------------------------------------------

    def _dispatch_ready(self) -> None:
        """Dispatch while the band whose turn it is has a request that may go (the room it keeps
        for its other flows under fair sharing is not handed to lower bands)."""
        while self._num_queued:
            backlogged = [b.config for b in self._bands.values() if b.queue]
            band = self._bands[pick_band(backlogged, self._shares).priority]
            pick = self._pick_flow(band)
            if pick is None:
                return
            entry = band.queue.pop_from(pick.flow_id)
            self._num_queued -= 1
            self._cancel_timer(entry)
            if not entry.outcome.done():      # done: its admit was cancelled and has not run yet
                now = self._clock()
                band.interval.dispatched(now)
                entry.outcome.set_result(self._dispatch(band, entry.request, now - entry.arrived_at,
                                                        pick.beyond_room))
            self._after_removal(band)

    def _pick_flow(self, band: _Band, newcomer: str | None = None) -> Pick | None:
        """The flow of `band` whose next request may go now, and whether beyond the room
        (`newcomer`: a flow with nothing waiting, counted as if its newcomer waited)."""
        waiting = band.queue.flows_in_turn()
        if newcomer is not None:
            waiting.append((newcomer, 1))
        if not self._fair_share:
            return Pick(waiting[0][0]) if self._capacity.has_room() else None
        room = self._sized.units() if self._sized is not None else None
        return pick_flow(band.flows, waiting, self._capacity.has_room(), room, self._num_in_flight, self._burst)

    def _goes_at_once(self, band: _Band, flow_id: str) -> Pick | None:
        """Under fair sharing, a newcomer of a flow with nothing waiting that would be dispatched
        first if it queued (its band's turn, its flow's pick) goes without queueing: no full band
        sheds another request for it, no wait estimate sheds it."""
        if not self._fair_share or band.queue.num_waiting(flow_id):
            return None
        backlogged = [b.config for b in self._bands.values() if b.queue or b is band]
        if pick_band(backlogged, self._shares) is not band.config:
            return None
        pick = self._pick_flow(band, newcomer=flow_id)
        return pick if pick is not None and pick.flow_id == flow_id else None

    def _dispatch(self, band: _Band, request: FlowRequest, waited_s: float, beyond_room: bool = False) -> Ticket:
        if beyond_room:
            self._sized.take(beyond_room=True)
        else:
            self._capacity.take()
        self._num_in_flight += 1
        band.flows.dispatched(request.flow_id)
        self._shares.record(band.config.priority)
        if self._metrics is not None:
            self._metrics.count_dispatch(band.config.priority, waited_s, beyond_room)
        return Ticket(request, band.config.priority, waited_s, lambda: self._release(band, request.flow_id))

    def _release(self, band: _Band, flow_id: str) -> None:
        self._capacity.give_back()
        self._num_in_flight -= 1
        band.flows.released(flow_id)
        self._dispatch_ready()

    # -- leaving without a ticket ------------------------------------------------------------

    def _abandon(self, band: _Band, entry: QueuedRequest) -> None:
        """The admit waiting on `entry` was cancelled: out of the queue, and back with its unit
        if a ticket reached it first."""
        if self._take_out(band, entry):
            log.debug("request %s (flow %s) left the priority %d queue: cancelled", entry.request.request_id,
                      entry.request.flow_id, band.config.priority)
            return
        outcome = entry.outcome
        if outcome.done() and not outcome.cancelled() and outcome.exception() is None:
            outcome.result().release()

    def _take_out(self, band: _Band, entry: QueuedRequest) -> bool:
        """Remove `entry` from its band's queue and stop its timer; False when it was not queued."""
        if not band.queue.remove(entry):
            return False
        self._num_queued -= 1
        self._cancel_timer(entry)
        self._after_removal(band)
        return True

    def _after_removal(self, band: _Band) -> None:
        if not band.queue:
            band.interval.became_idle()

    @staticmethod
    def _cancel_timer(entry: QueuedRequest) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None

    def _fail(self, band: _Band, entry: QueuedRequest, cause: ShedCause, message: str) -> None:
        if not entry.outcome.done():          # done: cancelled, its admit has not run yet
            entry.outcome.set_exception(self._shed(band, entry.request, cause, message))

    def _shed(self, band: _Band, request: FlowRequest, cause: ShedCause, message: str) -> Shed:
        """The Shed to raise for `request` (counted and logged here)."""
        queue_wait = band.interval.estimate_wait_s(len(band.queue))
        retry_after_s = max(1, math.ceil(queue_wait)) if queue_wait is not None else 1
        if self._metrics is not None:
            self._metrics.count_shed(band.config.priority, cause)
        log.debug("request %s (flow %s) shed from the priority %d queue: %s", request.request_id, request.flow_id,
                  band.config.priority, cause.value)
        return Shed(cause, band.config.priority, retry_after_s, f"request shed ({cause.dropped_reason}): {message}")
