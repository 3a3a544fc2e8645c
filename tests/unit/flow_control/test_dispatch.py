"""FlowController's dispatch: the fast path, order within a flow, between flows and between
bands, cancellation, tickets, and `wake` for capacity that frees by other means."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.services.flow_control import FlowControlConfig, FlowController, FlowRequest
from splitserve.testing.waiting import async_wait_until

from .conftest import WAIT_S, band, dispatch_order, harness


def test_with_room_and_nothing_queued_admit_returns_without_suspending():
    async def scenario():
        h = harness(max_in_flight=2)
        coro = h.controller.admit(FlowRequest("a"))
        with pytest.raises(StopIteration) as returned:
            coro.send(None)              # one step: it never waited on anything
        ticket = returned.value.value
        assert (ticket.band, ticket.waited_s, h.capacity.num_in_flight) == (0, 0.0, 1)
        assert h.controller.num_queued() == 0 and h.clock.slept == []
        ticket.release()
        h.assert_idle()

    asyncio.run(scenario())


def test_a_flow_is_served_in_arrival_order():
    async def scenario():
        h = harness()
        holder = await h.controller.admit(FlowRequest("a"))
        pending = {await h.queue(FlowRequest("a", request_id=f"a{i}")): f"a{i}" for i in range(5)}
        assert await dispatch_order(holder, pending) == ["a0", "a1", "a2", "a3", "a4"]
        h.assert_idle()

    asyncio.run(scenario())


def test_within_a_flow_the_earliest_deadline_goes_first_then_arrival_order():
    async def scenario():
        h = harness()
        holder = await h.controller.admit(FlowRequest("a"))
        pending = {}
        for name, deadline in (("none1", None), ("late", 50.0), ("none2", None), ("soon", 20.0)):
            pending[await h.queue(FlowRequest("a", ttft_deadline_s=deadline))] = name
        assert await dispatch_order(holder, pending) == ["soon", "late", "none1", "none2"]
        h.assert_idle()

    asyncio.run(scenario())


def test_a_flood_from_one_flow_delays_another_by_at_most_one_request_per_turn():
    async def scenario():
        h = harness()
        holder = await h.controller.admit(FlowRequest("a"))
        pending = {await h.queue(FlowRequest("flood")): f"flood{i}" for i in range(6)}
        pending |= {await h.queue(FlowRequest("quiet")): f"quiet{i}" for i in range(2)}
        order = await dispatch_order(holder, pending)
        assert order == ["flood0", "quiet0", "flood1", "quiet1", "flood2", "flood3", "flood4", "flood5"]
        h.assert_idle()

    asyncio.run(scenario())


def test_a_lower_priority_value_overtakes_requests_queued_before_it():
    async def scenario():
        h = harness(band(0), band(5))
        holder = await h.controller.admit(FlowRequest("a"))
        pending = {await h.queue(FlowRequest("batch", priority=5)): f"batch{i}" for i in range(3)}
        pending |= {await h.queue(FlowRequest("chat", priority=0)): f"chat{i}" for i in range(2)}
        pending[await h.queue(FlowRequest("other", priority=7))] = "unknown-priority"   # no band 7: the default (0)
        order = await dispatch_order(holder, pending)
        assert order == ["chat0", "unknown-priority", "chat1", "batch0", "batch1", "batch2"]
        h.assert_idle()

    asyncio.run(scenario())


@pytest.mark.parametrize("min_share", [0.0, 0.25])
def test_a_band_below_its_min_share_goes_before_a_higher_priority_band(min_share):
    async def scenario():
        window = 8
        h = harness(band(0), band(1, min_share=min_share), share_window=window)
        holder = await h.controller.admit(FlowRequest("a"))          # dispatch 1 of the window: high
        pending = {await h.queue(FlowRequest("low", priority=1)): "low" for _ in range(4)}
        pending |= {await h.queue(FlowRequest("high", priority=0)): "high" for _ in range(20)}
        history = ["high"] + await dispatch_order(holder, pending)
        last_low = max(i for i, name in enumerate(history) if name == "low")
        if min_share == 0:
            assert history[-4:] == ["low"] * 4                           # strict priority: low waits for all of high
        else:
            assert last_low < 20                                         # served while high still had 4+ queued
            # A band owed its share is served at the next dispatch: over every stretch of the
            # last `window` dispatches it is never more than one dispatch short of min_share.
            for end in range(1, last_low + 1):
                recent = history[max(0, end - window):end]
                assert recent.count("low") >= min_share * len(recent) - 1, (end, history)
        h.assert_idle()

    asyncio.run(scenario())


def test_a_cancelled_admit_leaves_its_queue_and_frees_nothing():
    async def scenario():
        h = harness(band(0, max_wait_s=5.0))
        holder = await h.controller.admit(FlowRequest("a"))
        gone = await h.queue(FlowRequest("a", request_id="gone"))
        stays = await h.queue(FlowRequest("a", request_id="stays"))
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert h.controller.num_queued() == 1 and h.capacity.num_in_flight == 1
        assert await dispatch_order(holder, {stays: "stays"}) == ["stays"]
        await h.no_tasks_left()           # the cancelled request's max_wait timer went with it
        h.assert_idle()

    asyncio.run(scenario())


def test_a_ticket_handed_to_a_cancelled_admit_is_given_back_and_goes_to_the_next():
    async def scenario():
        h = harness()
        holder = await h.controller.admit(FlowRequest("a"))
        first = await h.queue(FlowRequest("a"))
        second = await h.queue(FlowRequest("a"))
        holder.release()                  # `first` gets the unit ...
        first.cancel()                    # ... but its client leaves before it runs
        with pytest.raises(asyncio.CancelledError):
            await first
        ticket = await asyncio.wait_for(second, WAIT_S)
        assert h.capacity.num_in_flight == 1 and h.controller.num_queued() == 0
        ticket.release()
        h.assert_idle()

    asyncio.run(scenario())


def test_releasing_a_ticket_twice_gives_back_one_unit():
    async def scenario():
        h = harness(max_in_flight=2)
        first = await h.controller.admit(FlowRequest("a"))
        with await h.controller.admit(FlowRequest("a")):
            waiting = await h.queue(FlowRequest("a"))
            first.release()
            first.release()
            with first:                   # the context manager releases too: still nothing more
                pass
            assert first.released
            third = await asyncio.wait_for(waiting, WAIT_S)
            assert h.capacity.num_in_flight == 2
        third.release()
        h.assert_idle()

    asyncio.run(scenario())


def test_wake_dispatches_when_capacity_frees_by_other_means():
    class WorkerRoom:
        """Capacity a worker's stats decide: room while its queue has free slots."""

        def __init__(self) -> None:
            self.free_slots = 0
            self.num_taken = 0

        def has_room(self) -> bool:
            return self.free_slots > 0

        def take(self) -> None:
            self.free_slots -= 1
            self.num_taken += 1

        def give_back(self) -> None:
            self.num_taken -= 1

    async def scenario():
        room = WorkerRoom()
        controller = FlowController(FlowControlConfig(bands=(band(0),)), room)
        task = asyncio.create_task(controller.admit(FlowRequest("a")))
        await async_wait_until(lambda: controller.num_queued() == 1, timeout=WAIT_S, interval=0.001,
                               what="the request to queue")
        room.free_slots = 1               # a stats update says the worker has room
        controller.wake()
        ticket = await asyncio.wait_for(task, WAIT_S)
        assert room.num_taken == 1 and controller.num_queued() == 0
        ticket.release()
        assert room.num_taken == 0

    asyncio.run(scenario())
