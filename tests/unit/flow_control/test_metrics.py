"""Flow control's metrics after a scenario, read back from the registry passed in."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.services.flow_control import FlowRequest, Shed

from .conftest import WAIT_S, band, harness

QUEUED = "splitserve_flow_control_queued_requests"
FLOW_QUEUED = "splitserve_flow_control_flow_queued_requests"
WAIT = "splitserve_flow_control_wait_seconds"
DISPATCHED = "splitserve_flow_control_dispatched_total"
SHED = "splitserve_flow_control_shed_total"


def test_queue_lengths_waits_dispatches_and_sheds_per_band():
    async def scenario():
        h = harness(band(0, max_queue=3), band(1), num_flow_series=2)
        holder = await h.controller.admit(FlowRequest("a"))              # fast path: waited 0
        big = [await h.queue(FlowRequest("big")) for _ in range(2)]
        small = await h.queue(FlowRequest("small"))
        low = await h.queue(FlowRequest("tiny", priority=1))
        with pytest.raises(Shed):
            await h.queue(FlowRequest("big"))                           # band 0 full, big holds the most

        assert (h.sample(QUEUED, band="0"), h.sample(QUEUED, band="1")) == (3, 1)
        assert h.sample(FLOW_QUEUED, band="0", flow="big") == 2
        assert h.sample(FLOW_QUEUED, band="0", flow="small") == 1
        assert h.sample(FLOW_QUEUED, band="1", flow="tiny") == 1
        assert h.sample(SHED, band="0", reason="rejected-saturated", cause="queue_full") == 1

        h.clock.advance(0.5)
        holder.release()                                               # big's first waited 0.5 s
        first = await asyncio.wait_for(big[0], WAIT_S)
        h.clock.advance(0.25)
        first.release()                                                # small waited 0.75 s
        second = await asyncio.wait_for(small, WAIT_S)

        assert h.sample(DISPATCHED, band="0") == 3 and h.sample(DISPATCHED, band="1") is None
        assert h.sample(WAIT + "_count", band="0") == 3
        assert h.sample(WAIT + "_sum", band="0") == 1.25
        assert h.sample(WAIT + "_bucket", band="0", le="0.5") == 2     # 0 and 0.5
        assert (h.sample(QUEUED, band="0"), h.sample(FLOW_QUEUED, band="0", flow="small")) == (1, None)

        for task in (big[1], low):
            task.cancel()
        await asyncio.gather(big[1], low, return_exceptions=True)
        second.release()
        assert (h.sample(QUEUED, band="0"), h.sample(QUEUED, band="1")) == (0, 0)
        h.assert_idle()

    asyncio.run(scenario())


def test_only_the_busiest_flows_of_a_band_get_a_series():
    async def scenario():
        h = harness(num_flow_series=2)
        holder = await h.controller.admit(FlowRequest("a"))
        tasks = [await h.queue(FlowRequest(flow)) for flow in ("one", "three", "two", "three", "two", "three")]
        series = {s.labels["flow"]: s.value for family in h.registry.collect() if family.name == FLOW_QUEUED
                  for s in family.samples}
        assert series == {"three": 3, "two": 2}
        assert h.sample(QUEUED, band="0") == 6                         # the band's gauge still counts every flow
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        holder.release()
        h.assert_idle()

    asyncio.run(scenario())
