"""A band's queues on their own: the position a newcomer is given (the wait estimate's input)
and which request a full band drops."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from splitserve.services.flow_control import FlowRequest
from splitserve.services.flow_control.queues import BandQueue, QueuedRequest


@pytest.fixture
def make_entry():
    """Make a QueuedRequest (its outcome on a loop of its own: nothing here runs it)."""
    loop = asyncio.new_event_loop()

    def make(seq: int, flow_id: str, deadline_at: float | None = None) -> QueuedRequest:
        return QueuedRequest(FlowRequest(flow_id), seq, 0.0, deadline_at, loop.create_future())

    yield make
    loop.close()


def _pops_before(queue: BandQueue, entry: QueuedRequest) -> int:
    popped = 0
    while queue.pop_next() is not entry:
        popped += 1
    return popped


@pytest.mark.parametrize("seed", range(20))
def test_num_ahead_is_how_many_are_dispatched_before_a_newcomer(seed, make_entry):
    rng = random.Random(seed)
    flows = ["a", "b", "c", "d"]
    queue, seq = BandQueue(), 0
    for _ in range(rng.randint(0, 15)):
        deadline = rng.choice([None, float(rng.randint(1, 9))])
        queue.push(make_entry(seq, rng.choice(flows), deadline))
        seq += 1
    for _ in range(rng.randint(0, 5)):                    # some dispatched: the rotation moved on
        if len(queue):
            queue.pop_next()
    newcomer = make_entry(seq, rng.choice(flows + ["new"]), rng.choice([None, float(rng.randint(1, 9))]))
    ahead = queue.num_ahead(newcomer.request.flow_id, newcomer.order_key)
    queue.push(newcomer)
    assert _pops_before(queue, newcomer) == ahead


def test_the_victim_of_a_full_band_is_the_newest_of_the_largest_flow(make_entry):
    queue = BandQueue()
    for seq, flow in enumerate(["x", "y", "x", "y", "z"]):
        queue.push(make_entry(seq, flow))
    victim = queue.displacement_victim("w")               # x and y hold 2 each: y's newest arrived last
    assert (victim.request.flow_id, victim.seq) == ("y", 3)
    assert queue.displacement_victim("x") is None          # x, counting its newcomer, holds the most
    assert queue.displacement_victim("z") is None          # z, counting its newcomer, ties x and y


def test_remove_takes_an_entry_out_wherever_it_is(make_entry):
    queue = BandQueue()
    entries = [make_entry(0, "a", 5.0), make_entry(1, "a"), make_entry(2, "b")]
    for entry in entries:
        queue.push(entry)
    assert queue.remove(entries[0]) and not queue.remove(entries[0])
    assert queue.remove(entries[2])
    assert queue.num_queued_by_flow() == {"a": 1}
    assert queue.pop_next() is entries[1] and len(queue) == 0
    assert entries[1].order_key == (math.inf, 1)
