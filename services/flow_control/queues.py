"""One band's waiting requests: a queue per flow, the flows served round-robin.

Within a flow the request with the earliest TTFT deadline goes first, then the requests without
one in arrival order (key: deadline or +inf, then arrival). Between flows the band takes one
request from each flow that has any, in turn (a flow that empties leaves the rotation and joins
at its end when it queues again), so a flow that floods the band delays another flow's request
by at most one of its own per turn.

Fair sharing (fair_share.py) may pick another flow than the one whose turn it is: the lightest;
the flow it picks goes to the back of the turns all the same.

When the band is full, the request to drop comes from the flow that holds the most queued
requests: its newest one. A newcomer whose own flow would hold the most (ties included) is the
one dropped, so a flooding tenant can never push out another tenant's request.
"""

from __future__ import annotations

import asyncio
import bisect
import math
from collections import deque
from dataclasses import dataclass

from splitserve.services.flow_control.requests import FlowRequest


@dataclass(slots=True, eq=False)
class QueuedRequest:
    """A request waiting in a band; `outcome` resolves to its Ticket or fails with Shed."""

    request: FlowRequest
    seq: int                          # arrival order, unique per controller
    arrived_at: float
    deadline_at: float | None         # clock time of its TTFT deadline
    outcome: asyncio.Future
    timer: asyncio.Task | None = None  # sheds it at its deadline or max wait

    @property
    def order_key(self) -> tuple[float, int]:
        return (math.inf if self.deadline_at is None else self.deadline_at, self.seq)


class FlowQueue:
    """One flow's requests in a band, in dispatch order (EDF, then FCFS)."""

    __slots__ = ("_entries", "_keys")

    def __init__(self) -> None:
        self._entries: list[QueuedRequest] = []
        self._keys: list[tuple[float, int]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def num_before(self, key: tuple[float, int]) -> int:
        """How many of this flow's requests go before a request with `key`."""
        return bisect.bisect_left(self._keys, key)

    def push(self, entry: QueuedRequest) -> None:
        i = bisect.bisect_left(self._keys, entry.order_key)
        self._keys.insert(i, entry.order_key)
        self._entries.insert(i, entry)

    def pop_first(self) -> QueuedRequest:
        self._keys.pop(0)
        return self._entries.pop(0)

    def remove(self, entry: QueuedRequest) -> bool:
        i = bisect.bisect_left(self._keys, entry.order_key)
        if i < len(self._entries) and self._entries[i] is entry:
            del self._keys[i], self._entries[i]
            return True
        return False

    def newest(self) -> QueuedRequest:
        return max(self._entries, key=lambda e: e.seq)


class BandQueue:
    """The queued requests of one band, by flow, served round-robin between flows."""

    __slots__ = ("_flows", "_turns", "_num_queued")

    def __init__(self) -> None:
        self._flows: dict[str, FlowQueue] = {}
        self._turns: deque[str] = deque()        # flows with requests; the head goes next
        self._num_queued = 0

    def __len__(self) -> int:
        return self._num_queued

    def push(self, entry: QueuedRequest) -> None:
        flow_id = entry.request.flow_id
        flow = self._flows.get(flow_id)
        if flow is None:
            flow = self._flows[flow_id] = FlowQueue()
            self._turns.append(flow_id)
        flow.push(entry)
        self._num_queued += 1

    def pop_next(self) -> QueuedRequest:
        """The next request to dispatch: the first of the flow whose turn it is."""
        return self.pop_from(self._turns[0])

    def pop_from(self, flow_id: str) -> QueuedRequest:
        """The first request of `flow_id` (which has one); the flow goes to the back of the turns."""
        flow = self._flows[flow_id]
        entry = flow.pop_first()
        self._num_queued -= 1
        self._turns.remove(flow_id)
        if flow:
            self._turns.append(flow_id)
        else:
            del self._flows[flow_id]
        return entry

    def num_waiting(self, flow_id: str) -> int:
        flow = self._flows.get(flow_id)
        return len(flow) if flow is not None else 0

    def flows_in_turn(self) -> list[tuple[str, int]]:
        """(flow, requests waiting) of every flow with any, the one whose turn it is first."""
        return [(flow_id, len(self._flows[flow_id])) for flow_id in self._turns]

    def remove(self, entry: QueuedRequest) -> bool:
        """Take `entry` out wherever it is; False when it is not queued here."""
        flow_id = entry.request.flow_id
        flow = self._flows.get(flow_id)
        if flow is None or not flow.remove(entry):
            return False
        self._num_queued -= 1
        if not flow:
            self._turns.remove(flow_id)
            del self._flows[flow_id]
        return True

    def num_ahead(self, flow_id: str, key: tuple[float, int]) -> int:
        """How many queued requests would be dispatched before a new one of `flow_id` with `key`,
        if nothing else arrived: those of its own flow before it, and from each other flow one per
        round-robin turn until its own (one more from the flows whose turn comes before its flow's)."""
        own = self._flows.get(flow_id)
        k = own.num_before(key) if own is not None else 0
        position = self._turns.index(flow_id) if own is not None else len(self._turns)
        ahead = k
        for i, other_id in enumerate(self._turns):
            if other_id != flow_id:
                ahead += min(len(self._flows[other_id]), k + 1 if i < position else k)
        return ahead

    def displacement_victim(self, flow_id: str) -> QueuedRequest | None:
        """In a full band, the queued request to drop for a newcomer of `flow_id`: the newest
        request of the flow holding the most; None when the newcomer's flow, counting the
        newcomer, holds at least as many (the newcomer is the one to drop)."""
        own = self._flows.get(flow_id)
        newcomer_flow_size = (len(own) if own is not None else 0) + 1
        others = [flow for fid, flow in self._flows.items() if fid != flow_id]
        if not others:
            return None
        largest = max(len(flow) for flow in others)
        if newcomer_flow_size >= largest:
            return None
        newest = [flow.newest() for flow in others if len(flow) == largest]
        return max(newest, key=lambda e: e.seq)       # ties between flows: the most recent arrival goes

    def num_queued_by_flow(self) -> dict[str, int]:
        return {flow_id: len(flow) for flow_id, flow in list(self._flows.items())}
