"""WriteFences on a real engine: a given-up remote prefill's granted blocks stay owned by the
transfer until every prefill worker asked confirms it stopped writing, or until the grant
ran out on the (injected) clock; then they go back to the pool exactly once.

The prefill workers are fakes answering FenceTransfer as each test says (conftest.py);
time is a FakeClock, so a grant runs out when the test moves it. Every test ends with the
engine's pool all free.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.services.worker.kv.write_fences import FENCE_TIMEOUT_S, RETRY_S, WriteFences


def unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details=details)


async def settle() -> None:
    """Let the fence tasks run as far as they can without the clock moving."""
    for _ in range(20):
        await asyncio.sleep(0)


async def fenced_reservation(engine_loop, request_id: str, base: int) -> int:
    """A remote prefill reserved with write fences and given up; the number of granted blocks."""
    tokens = list(range(base, base + 40))                       # 3 blocks, none cached
    reservation = await engine_loop.call(
        lambda e: e.reserve_remote_prefill(request_id, tokens, SamplingParams(), fence_writes=True))
    assert reservation is not None
    assert await engine_loop.call(lambda e: e.cancel_remote_prefill(request_id))
    return len(reservation.block_ids)


def test_a_fence_is_released_once_every_prefill_worker_asked_confirms(engine_loop, peers, clock, engine_state):
    async def main():
        fences = WriteFences(engine_loop, peers, clock=clock, sleep=clock.sleep)
        first, second = peers.add("p0"), peers.add("p1")
        second.fence_gate = asyncio.Event()                     # p1 is still draining its writes
        num_granted = await fenced_reservation(engine_loop, "r", 20000)
        asks = [fences.ask("p0", "r"), fences.ask("p1", "r")]
        fences.release_when_stopped("r", asks, clock() + 100.0)
        await settle()
        waiting = await engine_state()
        assert waiting.transfer_owned == ("r",) and waiting.num_fenced_blocks == num_granted == 3
        second.fence_gate.set()
        await settle()
        assert first.fenced == second.fenced == ["r"]
        assert fences.num_confirmed == 1 and fences.num_waited_out == 0 and clock.slept == []
        assert (await engine_state()).all_free
    asyncio.run(main())


def test_an_unconfirmed_fence_waits_out_the_grant_on_the_clock(engine_loop, peers, clock, engine_state):
    async def main():
        fences = WriteFences(engine_loop, peers, clock=clock, sleep=clock.sleep)
        peers.add("p0").fence_answers = [False]                 # a write of its timed out
        await fenced_reservation(engine_loop, "r", 21000)
        fences.release_when_stopped("r", [fences.ask("p0", "r")], clock() + 5.0)
        await settle()
        assert clock.num_sleeping == 1 and (await engine_state()).num_fenced_blocks == 3
        clock.advance(4.9)
        await settle()
        assert (await engine_state()).num_fenced_blocks == 3      # the grant has not run out yet
        clock.advance(0.2)
        await settle()
        assert fences.num_waited_out == 1 and fences.num_confirmed == 0
        assert (await engine_state()).all_free
    asyncio.run(main())


def test_a_prefill_worker_that_nothing_listens_for_any_more_has_stopped_writing(engine_loop, peers, clock,
                                                                               engine_state):
    async def main():
        fences = WriteFences(engine_loop, peers, clock=clock, sleep=clock.sleep)
        peers.add("p0").fence_answers = [unavailable("failed to connect to all addresses; Connection refused")]
        await fenced_reservation(engine_loop, "r", 22000)
        fences.release_when_stopped("r", [fences.ask("p0", "r")], clock() + 100.0)
        await settle()
        assert fences.num_confirmed == 1 and clock.slept == []    # its process, and its writes, are gone
        assert (await engine_state()).all_free
    asyncio.run(main())


def test_an_unreachable_prefill_worker_is_asked_again_until_it_answers(engine_loop, peers, auto_clock,
                                                                      engine_state):
    async def main():
        fences = WriteFences(engine_loop, peers, clock=auto_clock, sleep=auto_clock.sleep)
        worker = peers.add("p0")
        worker.fence_answers = [unavailable("Socket closed"), unavailable("Socket closed"), True]
        await fenced_reservation(engine_loop, "r", 23000)
        fences.release_when_stopped("r", [fences.ask("p0", "r")], auto_clock() + 100.0)
        await settle()
        assert worker.fenced == ["r"] * 3 and auto_clock.slept == [RETRY_S, RETRY_S]
        assert fences.num_confirmed == 1
        assert (await engine_state()).all_free
    asyncio.run(main())


def test_a_prefill_worker_unreachable_for_the_whole_fence_timeout_is_waited_out(engine_loop, peers, auto_clock,
                                                                               engine_state):
    async def main():
        fences = WriteFences(engine_loop, peers, clock=auto_clock, sleep=auto_clock.sleep)
        worker = peers.add("p0")
        worker.fence_answers = [unavailable("Socket closed")]
        await fenced_reservation(engine_loop, "r", 24000)
        start = auto_clock()
        fences.release_when_stopped("r", [fences.ask("p0", "r")], start + 60.0)
        await settle()
        expected_attempts = FENCE_TIMEOUT_S / RETRY_S
        assert abs(len(worker.fenced) - expected_attempts) <= 1
        assert fences.num_waited_out == 1 and auto_clock() == pytest.approx(start + 60.0)  # released at the grant's end
        assert (await engine_state()).all_free
    asyncio.run(main())


def test_a_fence_releases_its_blocks_exactly_once(engine_loop, peers, clock, engine_state):
    async def main():
        fences = WriteFences(engine_loop, peers, clock=clock, sleep=clock.sleep)
        await fenced_reservation(engine_loop, "r", 25000)
        # The same request id lives on meanwhile (a retry reserved again): the fence's release
        # must give back the hold's blocks only.
        live = await engine_loop.call(
            lambda e: e.reserve_remote_prefill("r", list(range(26000, 26020)), SamplingParams()))
        assert live is not None
        fences.release_when_stopped("r", [], clock() + 100.0)    # no prefill worker was asked
        fences.release_when_stopped("r", [], clock() + 100.0)    # a second release for the same id
        await settle()
        state = await engine_state()
        assert state.transfer_owned == () and state.reserved == ("r",) and state.num_used_blocks == 2
        assert fences.num_confirmed == 2
        assert not await engine_loop.call(lambda e: e.release_transfer("r"))
        assert await engine_loop.call(lambda e: e.cancel_remote_prefill("r"))
        assert (await engine_state()).all_free                   # no block was released twice
    asyncio.run(main())
