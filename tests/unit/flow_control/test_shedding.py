"""Shedding: a full band sheds from its largest flow, deadlines judged on arrival and kept while
queued (on the fake clock), the band's max wait. A shed request never holds capacity."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.services.flow_control import DROPPED_REASON_HEADER, FlowRequest, Shed, ShedCause
from splitserve.testing.waiting import async_wait_until

from .conftest import WAIT_S, band, dispatch_order, harness


def test_the_header_is_llm_ds():
    assert DROPPED_REASON_HEADER == "x-llm-d-request-dropped-reason"


def test_a_full_band_sheds_the_largest_flows_newest_request_not_a_newcomer_from_another_flow():
    async def scenario():
        h = harness(band(0, max_queue=3))
        holder = await h.controller.admit(FlowRequest("a"))
        flood = [await h.queue(FlowRequest("flood", request_id=f"flood{i}")) for i in range(3)]
        assert h.controller.num_queued() == 3                          # the band is full

        other = await h.queue(FlowRequest("other"))                    # queued: flood's newest goes instead
        with pytest.raises(Shed) as shed:
            await asyncio.wait_for(flood[2], WAIT_S)
        assert (shed.value.cause, shed.value.reason, shed.value.band) == (ShedCause.DISPLACED, "rejected-saturated", 0)
        assert shed.value.retry_after_s >= 1
        assert h.controller.num_queued_by_flow() == {0: {"flood": 2, "other": 1}}

        with pytest.raises(Shed) as own:                               # flood's newcomer: flood holds the most
            await h.queue(FlowRequest("flood"))
        assert (own.value.cause, own.value.reason) == (ShedCause.QUEUE_FULL, "rejected-saturated")

        third = await h.queue(FlowRequest("third"))                    # a third tenant also gets in
        with pytest.raises(Shed):
            await asyncio.wait_for(flood[1], WAIT_S)
        assert h.capacity.num_in_flight == 1                           # none of the shed ones took a unit
        assert await dispatch_order(holder, {flood[0]: "flood0", other: "other", third: "third"}) == \
            ["flood0", "other", "third"]
        h.assert_idle()

    asyncio.run(scenario())


def test_a_full_band_with_flows_tied_for_most_sheds_the_newcomer():
    async def scenario():
        h = harness(band(0, max_queue=3))
        holder = await h.controller.admit(FlowRequest("a"))
        queued = {await h.queue(FlowRequest(flow)): flow for flow in ("x", "x", "y")}
        with pytest.raises(Shed) as shed:
            await h.queue(FlowRequest("y"))                            # y would hold 2, as many as x
        assert shed.value.cause is ShedCause.QUEUE_FULL
        assert await dispatch_order(holder, queued) == ["x", "y", "x"]
        h.assert_idle()

    asyncio.run(scenario())


async def _learn_one_second_interval(h) -> None:
    """One request waits 1 s for the unit, so the band's dispatch interval is 1 s."""
    holder = await h.controller.admit(FlowRequest("warm-up"))
    waiting = await h.queue(FlowRequest("warm-up"))
    h.clock.advance(1.0)
    holder.release()
    (await asyncio.wait_for(waiting, WAIT_S)).release()


def test_a_deadline_shorter_than_the_estimated_wait_is_shed_on_arrival():
    async def scenario():
        h = harness()
        await _learn_one_second_interval(h)
        holder = await h.controller.admit(FlowRequest("a"))
        ahead = await h.queue(FlowRequest("a"))                        # one ahead: the estimate is 2 x 1 s
        with pytest.raises(Shed) as shed:
            await h.queue(FlowRequest("b", ttft_deadline_s=1.5))
        assert (shed.value.cause, shed.value.reason) == (ShedCause.DEADLINE_UNMEETABLE, "rejected-saturated")
        assert h.controller.num_queued() == 1 and h.capacity.num_in_flight == 1
        meetable = await h.queue(FlowRequest("b", ttft_deadline_s=2.5))
        assert sorted(await dispatch_order(holder, {ahead: "ahead", meetable: "meetable"})) == ["ahead", "meetable"]
        h.assert_idle()

    asyncio.run(scenario())


def test_without_a_measured_interval_a_deadline_is_not_judged_on_arrival():
    async def scenario():
        h = harness()
        holder = await h.controller.admit(FlowRequest("a"))
        queued = await h.queue(FlowRequest("b", ttft_deadline_s=0.001))
        assert await dispatch_order(holder, {queued: "b"}) == ["b"]
        h.assert_idle()

    asyncio.run(scenario())


def test_a_queued_request_is_shed_at_its_deadline_on_the_clock():
    async def scenario():
        h = harness(band(0, max_wait_s=60.0))
        holder = await h.controller.admit(FlowRequest("a"))
        task = await h.queue(FlowRequest("b", ttft_deadline_s=0.5))
        await async_wait_until(lambda: h.clock.num_sleeping == 1, timeout=WAIT_S, interval=0.001,
                               what="the deadline timer to sleep")
        h.clock.advance(0.25)
        for _ in range(3):
            await asyncio.sleep(0)                                     # let anything that is due run
        assert not task.done()                                         # before the deadline: still queued
        h.clock.advance(0.25)
        with pytest.raises(Shed) as shed:
            await asyncio.wait_for(task, WAIT_S)
        assert (shed.value.cause, shed.value.reason) == (ShedCause.DEADLINE_PASSED, "rejected-ttl-expired")
        assert h.clock() == 0.5 and h.clock.slept == [0.5]             # one timer, due exactly at the deadline
        assert h.controller.num_queued() == 0 and h.capacity.num_in_flight == 1
        holder.release()
        h.assert_idle()

    asyncio.run(scenario())


def test_a_request_queued_past_the_bands_max_wait_is_shed():
    async def scenario():
        h = harness(band(0, max_wait_s=2.0))
        holder = await h.controller.admit(FlowRequest("a"))
        no_deadline = await h.queue(FlowRequest("b"))
        later_deadline = await h.queue(FlowRequest("c", ttft_deadline_s=5.0))
        h.clock.advance(2.0)
        for task in (no_deadline, later_deadline):
            with pytest.raises(Shed) as shed:
                await asyncio.wait_for(task, WAIT_S)
            assert (shed.value.cause, shed.value.reason) == (ShedCause.MAX_WAIT, "rejected-ttl-expired")
        assert h.capacity.num_in_flight == 1
        holder.release()
        await h.no_tasks_left()
        h.assert_idle()

    asyncio.run(scenario())


def test_a_request_dispatched_before_its_deadline_is_not_shed_later():
    async def scenario():
        h = harness(band(0, max_wait_s=1.0))
        holder = await h.controller.admit(FlowRequest("a"))
        task = await h.queue(FlowRequest("b", ttft_deadline_s=0.5))
        holder.release()
        ticket = await asyncio.wait_for(task, WAIT_S)
        h.clock.advance(5.0)                                           # past deadline and max wait
        await h.no_tasks_left()                                        # its timer was stopped at dispatch
        assert not ticket.released and h.capacity.num_in_flight == 1
        assert h.sample("splitserve_flow_control_shed_total", band="0", reason="rejected-ttl-expired",
                        cause="deadline_passed") is None
        ticket.release()
        h.assert_idle()

    asyncio.run(scenario())
