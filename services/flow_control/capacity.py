"""What a dispatched request holds: a unit of capacity, behind one small protocol.

The controller asks `has_room()` before each dispatch, `take()`s one unit for the request it
dispatches and `give_back()`s it when the request's ticket is released. `ConcurrencyLimit` (at
most N requests in flight) is the default; a caller whose room changes by other means (a worker's
stats: free KV blocks, queue depth) implements the protocol over those and calls
`FlowController.wake()` when room appears.

A capacity that can also tell the room's size (`units()`, a `SizedCapacity`, as
`ConcurrencyLimit` and the frontend's `WorkerSlots`) gets fair sharing's shares and bursts
(fair_share.py): the controller may then `take(beyond_room=True)` a unit past the room, for a
steady flow's request while a flooding flow holds units.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


class Capacity(Protocol):
    """The room dispatched requests use; called only from the event loop's thread."""

    def has_room(self) -> bool:
        """Whether one more request may be dispatched now (asks; changes nothing)."""

    def take(self) -> None:
        """Book one unit for a request being dispatched (called only after `has_room()` said yes)."""

    def give_back(self) -> None:
        """Return the unit a dispatched request took (its ticket was released)."""


@runtime_checkable
class SizedCapacity(Capacity, Protocol):
    """A Capacity whose room has a known size, which fair sharing divides between flows."""

    def units(self) -> int:
        """All the room there is now, in requests (taken or not)."""

    def take(self, beyond_room: bool = False) -> None:
        """Book one unit; `beyond_room`: past the room, which `has_room()` need not have said."""


@dataclass(slots=True)
class ConcurrencyLimit:
    """At most `max_in_flight` requests dispatched and not yet released (more only when taken
    `beyond_room`: fair sharing's burst)."""

    max_in_flight: int
    num_in_flight: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_in_flight, bool) or not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an integer >= 1, not {self.max_in_flight!r}")

    def has_room(self) -> bool:
        return self.num_in_flight < self.max_in_flight

    def units(self) -> int:
        return self.max_in_flight

    def take(self, beyond_room: bool = False) -> None:
        if self.num_in_flight >= self.max_in_flight and not beyond_room:
            raise RuntimeError(f"take() with all {self.max_in_flight} units in flight")
        self.num_in_flight += 1

    def give_back(self) -> None:
        if self.num_in_flight == 0:
            raise RuntimeError("give_back() with nothing in flight")
        self.num_in_flight -= 1
