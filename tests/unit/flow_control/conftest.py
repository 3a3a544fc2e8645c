"""Helpers for flow control's tests: a controller on a FakeClock, queueing in a known order,
and the order in which queued requests are dispatched.

Nothing sleeps on real time: the controller's clock and sleep are a FakeClock's, and a test
moves time with `advance`. Waits are for conditions (a request queued, a task done), each
bounded by WAIT_S of real time so that a bug fails instead of hanging.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from splitserve.services.flow_control import (BandConfig, ConcurrencyLimit, FlowControlConfig, FlowControlMetrics,
                                              FlowController, FlowRequest, Ticket)
from splitserve.testing.clock import FakeClock
from splitserve.testing.waiting import async_wait_until

WAIT_S = 10.0


@dataclass(slots=True)
class Harness:
    controller: FlowController
    capacity: ConcurrencyLimit
    clock: FakeClock
    registry: CollectorRegistry

    async def queue(self, request: FlowRequest) -> asyncio.Task:
        """Start `admit(request)` and return once it waits in its band (so arrival order is known)."""
        before = self.num_queued_of(request.flow_id)
        task = asyncio.create_task(self.controller.admit(request))
        await async_wait_until(lambda: task.done() or self.num_queued_of(request.flow_id) > before, timeout=WAIT_S,
                               interval=0.001, what=f"{request} to be queued")
        if task.done():
            task.result()             # a Shed on arrival: raise it here
        return task

    def num_queued_of(self, flow_id: str) -> int:
        return sum(flows.get(flow_id, 0) for flows in self.controller.num_queued_by_flow().values())

    def assert_idle(self) -> None:
        """The leak check: nothing queued, nothing in flight."""
        assert self.controller.num_queued() == 0
        assert self.capacity.num_in_flight == 0

    async def no_tasks_left(self) -> None:
        """Wait until no task but the test's own is left (queued requests' timers included)."""
        me = asyncio.current_task()
        await async_wait_until(lambda: asyncio.all_tasks() == {me}, timeout=WAIT_S, interval=0.001,
                               what="every other task to end", details=asyncio.all_tasks)

    def sample(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)


def band(priority: int, max_queue: int = 100, max_wait_s: float = float("inf"), min_share: float = 0.0) -> BandConfig:
    return BandConfig(priority=priority, max_queue=max_queue, max_wait_s=max_wait_s, min_share=min_share)


def harness(*bands: BandConfig, max_in_flight: int = 1, default_priority: int | None = None,
            share_window: int = 100, num_flow_series: int = 10, fair_share: bool = True,
            burst: int = 0) -> Harness:
    """A controller over `max_in_flight` units, fair sharing on. No burst unless asked: most tests
    count what one release dispatches (test_fair_share.py asks for it)."""
    bands = bands or (band(0),)
    config = FlowControlConfig(bands=bands, share_window=share_window,
                               default_priority=bands[0].priority if default_priority is None else default_priority,
                               fair_share=fair_share, burst=burst)
    clock = FakeClock()
    registry = CollectorRegistry()
    capacity = ConcurrencyLimit(max_in_flight)
    controller = FlowController(config, capacity, clock=clock, sleep=clock.sleep,
                                metrics=FlowControlMetrics(registry, num_flow_series=num_flow_series))
    return Harness(controller, capacity, clock, registry)


async def dispatch_order(holder: Ticket, pending: dict[asyncio.Task, str]) -> list[str]:
    """With one unit of capacity held by `holder`: release it, see which queued request gets the
    unit, let that one finish, and so on until every pending request ran; their names in order."""
    order = []
    while pending:
        holder.release()
        done, _ = await asyncio.wait(pending, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, f"one release dispatched {len(done)} requests"
        task = done.pop()
        order.append(pending.pop(task))
        holder = task.result()
    holder.release()
    return order
