"""Fair sharing between the flows of one band: which flow goes next, how much of the room a
flooding flow may hold, and when a lighter flow's request may go beyond the room.

Round-robin alone lets a flow that floods hold every unit of a small room: a steady tenant's
arrival then waits until one of the flood's requests ends, and runs in a batch full of them.
With `FlowControlConfig.fair_share` on, within each band:

- **Active**: a flow with requests in flight or waiting.
- **Heaviest, lighter**: the heaviest flows are the active ones with the most requests waiting
  (the ones a full band sheds from), a newcomer counted as waiting; every other active flow is
  lighter, one with requests in flight and nothing waiting included.
- **Order**: the next request comes from the flow holding the fewest units (max-min fairness);
  ties go round-robin, a flow just served going to the back.
- **Share**: while a lighter flow is active, a heaviest flow holds at most its fair share of the
  room: the room's units divided by the band's active flows, rounded down, at least 1. The rest
  stays free for the lighter flows' next arrivals, and the workers' batches are not filled with
  the flood's requests.
- **Burst**: a lighter flow's request may go beyond the room, by up to `burst` units in all (and
  never by more than the room itself), while a heaviest flow holds units: a steady tenant does
  not wait for a flood's requests to end. Heaviest flows take units only within the room, so the
  room drains back below its size as their requests end.

A lone flow, and flows that are level (as many waiting), use the whole room, by the order alone.
Share and burst need the room's size (`units()`, capacity.py); over a capacity that cannot tell,
only the order applies. A flow held back by its share holds units, so it is looked at again when
one of them is released.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Pick:
    """The flow whose next request goes now, and whether it goes beyond the room."""

    flow_id: str
    beyond_room: bool = False


class FlowLedger:
    """The units each flow of one band holds (waiting requests are counted by the band's queue)."""

    __slots__ = ("_in_flight",)

    def __init__(self) -> None:
        self._in_flight: dict[str, int] = {}

    def dispatched(self, flow_id: str) -> None:
        self._in_flight[flow_id] = self._in_flight.get(flow_id, 0) + 1

    def released(self, flow_id: str) -> None:
        left = self._in_flight[flow_id] - 1
        if left:
            self._in_flight[flow_id] = left
        else:
            del self._in_flight[flow_id]

    def in_flight(self, flow_id: str) -> int:
        return self._in_flight.get(flow_id, 0)

    def num_holding_only(self, waiting: Collection[str]) -> int:
        """How many flows hold units and have nothing waiting."""
        return sum(1 for flow_id in self._in_flight if flow_id not in waiting)


def pick_flow(ledger: FlowLedger, waiting: Sequence[tuple[str, int]], has_room: bool, room: int | None,
              in_flight: int, burst: int) -> Pick | None:
    """The flow of one band whose next request may be dispatched now, or None.

    waiting: (flow, requests waiting) for each flow with any, in round-robin order;
    has_room: whether the capacity has a unit free; room: its size in units (None: unknown, so
    only the order applies); in_flight: units taken from it now, all bands together."""
    order = sorted(range(len(waiting)), key=lambda i: (ledger.in_flight(waiting[i][0]), i))
    if room is None:
        return Pick(waiting[order[0]][0]) if has_room else None
    most = max(count for _, count in waiting)
    holding_only = ledger.num_holding_only(dict(waiting))
    lighter = holding_only + sum(1 for _, count in waiting if count < most)
    share = max(1, room // (len(waiting) + holding_only))
    heavy_units = sum(ledger.in_flight(flow_id) for flow_id, count in waiting if count == most)
    for i in order:
        flow_id, count = waiting[i]
        heaviest = count == most
        if heaviest and lighter and ledger.in_flight(flow_id) >= share:
            continue                           # at its share while a lighter flow is active
        if has_room:
            return Pick(flow_id)
        if not heaviest and heavy_units and in_flight < room + min(burst, room):
            return Pick(flow_id, beyond_room=True)
    return None
