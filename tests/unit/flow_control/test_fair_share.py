"""Fair sharing between the flows of a band (fair_share.py) over a room of several units: a
steady flow's arrival is dispatched at once beside a flood, the flood holds at most its share
while the steady flow is active, a lone flow uses the whole room, the burst beyond the room is
bounded, and strict priority between bands still holds."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.services.flow_control import FlowRequest, Shed, Ticket
from splitserve.services.flow_control.fair_share import FlowLedger, Pick, pick_flow

from .conftest import WAIT_S, band
from .conftest import harness as _harness

BURST = "splitserve_flow_control_burst_dispatched_total"
SHED = "splitserve_flow_control_shed_total"


def harness(*bands, **kwargs):
    """The conftest's harness with FlowControlConfig's default burst (4 units)."""
    return _harness(*bands, **{"burst": 4, **kwargs})


async def _flood(h, flow: str, held: int, waiting: int) -> tuple[list, list[asyncio.Task]]:
    """`flow` takes `held` units on arrival (the fast path), then `waiting` more requests queue."""
    tickets = [await asyncio.wait_for(h.controller.admit(FlowRequest(flow)), WAIT_S) for _ in range(held)]
    return tickets, [await h.queue(FlowRequest(flow, request_id=f"{flow}{i}")) for i in range(waiting)]


def _in_flight_of(tickets, flow: str) -> int:
    return sum(1 for t in tickets if not t.released and t.request.flow_id == flow)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def _wind_down(h, tickets: list, tasks: list[asyncio.Task]) -> None:
    """Cancel what still waits, release every ticket, and check that nothing is left."""
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for ticket in [*tickets, *results]:
        if isinstance(ticket, Ticket):
            ticket.release()                 # a second release does nothing
    h.assert_idle()


@pytest.mark.parametrize("fair_share", [True, False])
def test_a_steady_flows_arrival_is_dispatched_at_once_beside_a_flood(fair_share):
    async def scenario():
        h = harness(max_in_flight=4, fair_share=fair_share)
        flood, waiting = await _flood(h, "A", held=4, waiting=6)
        steady = await h.queue(FlowRequest("B"))
        if fair_share:                 # beyond the room: it does not wait for one of A's requests to end
            assert steady.done()
            ticket = steady.result()
            assert h.capacity.num_in_flight == 5 and h.sample(BURST, band="0") == 1
        else:                          # round-robin: B waits for a unit, A's turn comes first
            flood.pop(0).release()
            await _settle()
            assert not steady.done() and h.capacity.num_in_flight == 4
            flood.pop(0).release()
            ticket = await asyncio.wait_for(steady, WAIT_S)
        await _wind_down(h, [ticket, *flood], waiting)

    asyncio.run(scenario())


def test_a_steady_flows_arrival_beside_a_flood_neither_displaces_a_request_nor_is_judged_by_the_queue():
    """It goes without queueing: a full band sheds none of A's requests for it, and a deadline
    shorter than the queue's estimated wait does not shed it."""
    async def scenario():
        h = harness(band(0, max_queue=4), max_in_flight=4)
        flood, (first,) = await _flood(h, "A", held=4, waiting=1)
        h.clock.advance(1.0)
        flood.pop(0).release()                                        # the wait estimate: 1 s a dispatch
        flood.append(await asyncio.wait_for(first, WAIT_S))
        waiting = [await h.queue(FlowRequest("A")) for _ in range(4)]  # the band is full
        steady = await h.queue(FlowRequest("B", ttft_deadline_s=0.5))  # the queue says 2 s at least
        assert steady.done() and h.capacity.num_in_flight == 5
        assert h.controller.num_queued() == 4 and not any(task.done() for task in waiting)
        assert h.sample(SHED, band="0", reason="rejected-saturated", cause="displaced") is None
        await _wind_down(h, [steady.result(), *flood], waiting)

    asyncio.run(scenario())


def test_a_flood_holds_at_most_its_share_while_a_steady_flow_is_active_and_the_rest_stays_free():
    async def scenario():
        h = harness(max_in_flight=4)
        tickets, waiting = await _flood(h, "A", held=4, waiting=8)
        steady = await h.queue(FlowRequest("B"))                      # beyond the room (see above)
        tickets.append(steady.result())

        async def end_one_of_a() -> int:
            """One of A's requests ends; A's units once flow control has dispatched what it may."""
            next(t for t in tickets if t.request.flow_id == "A" and not t.released).release()
            await _settle()
            tickets.extend(task.result() for task in waiting if task.done() and task.result() not in tickets)
            return _in_flight_of(tickets, "A")

        # A takes units again only within the room and up to its share, 4 units // 2 active
        # flows = 2: its units only go down until it is below that share.
        assert [await end_one_of_a() for _ in range(3)] == [3, 2, 2]
        assert h.capacity.num_in_flight == 3                           # B's 1 and A's 2: one unit kept free
        second = await h.queue(FlowRequest("B"))                      # B's next arrival finds it
        assert second.done() and h.sample(BURST, band="0") == 1       # within the room: no second burst
        tickets.append(second.result())
        assert await end_one_of_a() == 2 and h.capacity.num_in_flight == 4   # below its share: A takes a unit
        await _wind_down(h, tickets, waiting)

    asyncio.run(scenario())


def test_a_lone_flow_uses_the_whole_room_and_gets_it_back_when_the_other_is_done():
    async def scenario():
        h = harness(max_in_flight=4)
        tickets, waiting = await _flood(h, "A", held=4, waiting=6)

        async def end_one() -> int:
            """The oldest of A's requests ends; the units in flight once flow control dispatched what it may."""
            tickets.pop(0).release()
            await _settle()
            tickets.extend(task.result() for task in waiting if task.done() and task.result() not in tickets)
            return h.capacity.num_in_flight

        assert [await end_one() for _ in range(2)] == [4, 4]           # alone: A takes back every unit
        steady = (await h.queue(FlowRequest("B"))).result()            # beyond the room
        assert [await end_one() for _ in range(2)] == [4, 3]           # A down to its share, 2 of 4
        steady.release()                                               # B is done: A alone again
        await _settle()
        tickets.extend(task.result() for task in waiting if task.done() and task.result() not in tickets)
        assert h.capacity.num_in_flight == 4 and _in_flight_of(tickets, "A") == 4
        await _wind_down(h, tickets, waiting)

    asyncio.run(scenario())


def test_a_flood_that_starts_beside_a_running_flow_gets_its_share_from_its_first_request():
    async def scenario():
        h = harness(max_in_flight=4)
        running = await asyncio.wait_for(h.controller.admit(FlowRequest("B")), WAIT_S)
        arrivals = [await h.queue(FlowRequest("A")) for _ in range(4)]
        assert [task.done() for task in arrivals] == [True, True, False, False]   # 4 // 2 = 2 units
        assert h.capacity.num_in_flight == 3                           # one unit free for B
        second = await h.queue(FlowRequest("B"))
        assert second.done() and h.sample(BURST, band="0") is None     # within the room
        await _wind_down(h, [running, second.result()], arrivals)

    asyncio.run(scenario())


@pytest.mark.parametrize("burst", [0, 2])
def test_the_burst_beyond_the_room_is_bounded(burst):
    async def scenario():
        h = harness(max_in_flight=4, burst=burst)
        flood, waiting = await _flood(h, "A", held=4, waiting=3)
        steady = [await h.queue(FlowRequest("B")) for _ in range(3)]
        went = [task.done() for task in steady]
        assert went == [i < burst for i in range(3)]
        assert h.capacity.num_in_flight == 4 + burst
        flood.pop(0).release()             # the room drains: B's waiting request goes first, A's wait
        if burst:
            assert (await asyncio.wait_for(steady[burst], WAIT_S)).request.flow_id == "B"
            assert h.capacity.num_in_flight == 4 + burst
        else:
            await _settle()
            assert steady[0].done() and not steady[1].done()            # within the room again
        await _wind_down(h, flood, waiting + steady)

    asyncio.run(scenario())


def test_a_steady_flow_in_a_lower_band_does_not_burst_past_a_higher_bands_flood():
    async def scenario():
        h = harness(band(0), band(5), max_in_flight=2)
        flood, waiting = await _flood(h, "A", held=2, waiting=2)
        low = await h.queue(FlowRequest("B", priority=5))
        await _settle()
        assert not low.done() and h.capacity.num_in_flight == 2
        await _wind_down(h, flood, [*waiting, low])

    asyncio.run(scenario())


def test_two_floods_take_turns_and_keep_the_room_busy():
    async def scenario():
        h = harness(band(0, max_queue=8), max_in_flight=2)
        tickets = [await h.controller.admit(FlowRequest("A")) for _ in range(2)]
        waiting: list[asyncio.Task] = []

        async def both_send() -> None:
            for flow in ("A", "D"):
                try:
                    waiting.append(await h.queue(FlowRequest(flow)))
                except Shed:                   # the band is full: the flow holding the most loses one
                    pass

        def collect() -> list:
            new = [task.result() for task in waiting if task.done() and not task.cancelled()
                   and task.exception() is None and task.result() not in tickets]
            tickets.extend(new)
            return new

        for _ in range(6):
            await both_send()
        served = collect()
        for _ in range(40):                    # the oldest request ends, each flood sends one more
            tickets[0].release()
            tickets.pop(0)
            await _settle()
            served += collect()
            await both_send()
            served += collect()
            assert h.capacity.num_in_flight >= 2                       # no unit kept free: nobody is steady
        later = [t.request.flow_id for t in served[4:]]
        assert abs(later.count("A") - later.count("D")) <= 2, later
        await _wind_down(h, tickets, waiting)

    asyncio.run(scenario())


def test_pick_flow_without_the_rooms_size_only_orders():
    ledger = FlowLedger()
    ledger.dispatched("A")
    waiting = [("A", 3), ("B", 1)]
    assert pick_flow(ledger, waiting, has_room=True, room=None, in_flight=1, burst=4) == Pick("B")
    assert pick_flow(ledger, waiting, has_room=False, room=None, in_flight=1, burst=4) is None


def test_the_ledger_counts_units_per_flow_and_the_flows_that_only_hold_units():
    ledger = FlowLedger()
    for flow in ("B", "B", "C"):
        ledger.dispatched(flow)
    assert (ledger.in_flight("B"), ledger.in_flight("C"), ledger.in_flight("D")) == (2, 1, 0)
    assert ledger.num_holding_only({}) == 2 and ledger.num_holding_only({"C": 1}) == 1
    ledger.released("C")
    ledger.released("B")
    assert ledger.num_holding_only({}) == 1 and ledger.in_flight("C") == 0
