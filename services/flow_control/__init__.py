"""Flow control (issue 40): priority bands, fairness between flows, bounded queues, TTFT
deadlines and shedding with 429, as a pure asyncio library (no HTTP, no gRPC).

One implementation for splitserve's frontend and for the endpoint picker (`splitserve epp`), which
call `FlowController.admit` before routing a request (services/frontend/flow_admission.py, under
--flow-control; the picker through the same class). One job per module:

- `config.py`          `FlowControlConfig` and its `BandConfig`s (validated on construction);
- `requests.py`        `FlowRequest`: flow, priority (vLLM's direction: lower goes first), deadline;
- `capacity.py`        `Capacity`, what a dispatched request holds; `SizedCapacity`; `ConcurrencyLimit`;
- `queues.py`          one band's queues: per flow EDF then FCFS, round-robin between flows;
- `dispatch_order.py`  which band goes next: strict priority, except a band owed its `min_share`;
- `fair_share.py`      which flow of a band goes next, and how much of the room each may hold:
                       the fewest units first; a flood (the flow with the most waiting) held to its
                       fair share while a lighter flow is active, the lighter flow's requests
                       dispatched at once, up to `burst` units beyond the room (see its docstring);
- `wait_estimate.py`   a newcomer's expected wait: position × the band's dispatch-interval EWMA;
- `shedding.py`        `Shed` (429) and its `x-llm-d-request-dropped-reason`;
- `controller.py`      `FlowController` (`admit` → `Ticket`, `wake`), the timers that shed;
- `metrics.py`         `FlowControlMetrics` on a registry the caller passes.

Fairness between the flows of a band (`FlowControlConfig.fair_share`, on by default) is what keeps
a steady tenant nearly as fast beside a flooding one as alone. A flood waiting in a small room
would otherwise hold every unit: the steady tenant's arrival waits for one of its requests to end
(with C units, 1/C of a request's whole time on average) and then shares the workers' batch with
C - 1 of them. So the flood, the flow with the most requests waiting, holds at most room / active
flows (those with requests in flight or waiting) while a lighter flow is active, and a lighter
flow's request that finds the room full goes at once, beyond it by up to `burst` units; the flood
takes units only within the room, so the room drains back. A lone flow, or flows that are level,
use the whole room (work-conserving); the flow holding the fewest units goes first, ties in
round-robin order. Strict priority between bands is kept: a flow bursts only when its band is the
one whose turn it is.

Use, per request:

    controller = FlowController(FlowControlConfig(bands=(BandConfig(0, 256, 30.0),
                                                         BandConfig(10, 1024, 120.0, min_share=0.1))),
                                ConcurrencyLimit(64), metrics=FlowControlMetrics(registry))
    try:
        ticket = await controller.admit(FlowRequest(flow_id, priority, ttft_deadline_s))
    except Shed as shed:
        ...   # 429, shed.reason in DROPPED_REASON_HEADER, Retry-After: shed.retry_after_s
    with ticket:
        ...   # route and serve the request
"""

from splitserve.services.flow_control.capacity import Capacity, ConcurrencyLimit, SizedCapacity
from splitserve.services.flow_control.config import BandConfig, FlowControlConfig
from splitserve.services.flow_control.controller import FlowController, Ticket
from splitserve.services.flow_control.metrics import FlowControlMetrics
from splitserve.services.flow_control.requests import (FAIRNESS_ID_HEADER, OBJECTIVE_HEADER, TTFT_SLO_HEADER,
                                                       FlowRequest)
from splitserve.services.flow_control.shedding import DROPPED_REASON_HEADER, Shed, ShedCause

__all__ = [
    "DROPPED_REASON_HEADER", "FAIRNESS_ID_HEADER", "OBJECTIVE_HEADER", "TTFT_SLO_HEADER",
    "BandConfig", "Capacity", "ConcurrencyLimit", "FlowControlConfig", "FlowControlMetrics", "FlowController",
    "FlowRequest", "Shed", "ShedCause", "SizedCapacity", "Ticket",
]
