"""RemotePrefill, the decode side of a disaggregated request, on a real engine and engine loop.

The prefill workers and the transfer's receiver are fakes (conftest.py): a Prefill
call "fills" the reservation by completing the receiver with a first token, or fails
the way a refused, broken or hung worker does. Every test ends with the engine's pool
all free: no path (success, retry, local fallback, deadline, cancellation, abort)
leaves a block reserved or owned by a transfer once its fences are answered.
"""

from __future__ import annotations

import asyncio

import pytest

from splitserve.services.engine.sampler import SampledToken
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.services.worker.kv.remote_prefill import RemotePrefill
from splitserve.kvtransfer.sender_receiver import GRANT_GRACE_S, TransferError
from splitserve.services.worker.kv.write_fences import WriteFences
from splitserve.testing.waiting import async_wait_until

THRESHOLD = 32
TIMEOUT_S = 30.0


def prompt(base: int, n: int = 40) -> list[int]:
    """`n` token ids no other test uses (the engine and its prefix cache are shared)."""
    return list(range(base, base + n))


def remote_prefill(engine_loop, receiver, peers, clock, timeout_s: float = TIMEOUT_S) -> RemotePrefill:
    fences = WriteFences(engine_loop, peers, clock=clock, sleep=clock.sleep)
    return RemotePrefill(engine_loop, receiver, peers, THRESHOLD, timeout_s, fences)


async def settle() -> None:
    """Let the background fence tasks run as far as they can without the clock moving."""
    for _ in range(20):
        await asyncio.sleep(0)


async def prefill_locally(engine_loop, request_id: str, token_ids: list[int], max_tokens: int = 1) -> list:
    start = lambda e: e.add_request(request_id, token_ids, SamplingParams(max_tokens=max_tokens))  # noqa: E731
    return [out async for out in engine_loop.stream(request_id, start)]


async def decode(engine_loop, remote: RemotePrefill, request_id: str, first_token: SampledToken) -> list[int]:
    outputs = [out async for out in engine_loop.stream(request_id, remote.complete(request_id, first_token))]
    assert outputs[-1].finished
    return [t for out in outputs for t in out.new_token_ids]


def test_only_the_uncached_part_of_the_prompt_counts_against_the_threshold(engine_loop, receiver, peers, clock,
                                                                           engine_state):
    async def main():
        remote = remote_prefill(engine_loop, receiver, peers, clock)
        tokens = prompt(1000)                                   # 40 tokens, nothing cached
        assert await remote.worth_it(tokens)
        remote.threshold_tokens = 41
        assert not await remote.worth_it(tokens)
        await prefill_locally(engine_loop, "warm", tokens)      # caches 2 full blocks (32 tokens)
        remote.threshold_tokens = THRESHOLD
        assert not await remote.worth_it(tokens)                # 8 uncached tokens
        remote.threshold_tokens = 8
        assert await remote.worth_it(tokens)
        remote.threshold_tokens = 0
        assert not await remote.worth_it(tokens[:32])           # all cached: nothing to send
        assert (await engine_state()).all_free
    asyncio.run(main())


def test_a_filled_reservation_decodes_from_the_prefill_workers_first_token(engine_loop, receiver, peers, clock,
                                                                          engine_state):
    async def main():
        remote = remote_prefill(engine_loop, receiver, peers, clock)
        worker = peers.add("p0")
        retries = []
        outcome = await remote.run("r", prompt(2000), SamplingParams(max_tokens=3, ignore_eos=True), ["p0"],
                                   lambda: retries.append(1))
        assert outcome.first_token == SampledToken(7) and outcome.num_failures == 0 and retries == []
        held = await engine_state()
        assert held.reserved == ("r",) and held.num_used_blocks == 3 and held.transfer_owned == ()
        [request] = worker.prefill_requests
        assert list(request.token_ids) == prompt(2000) and request.target.num_cached_blocks == 0
        assert receiver.released == ["r"] and receiver.num_open() == 0   # the grant ended with the transfer
        tokens = await decode(engine_loop, remote, "r", outcome.first_token)
        assert tokens[0] == 7 and len(tokens) == 3
        await settle()
        assert worker.fenced == []                              # a prefill that succeeded is not fenced
        assert (await engine_state()).all_free
    asyncio.run(main())


def test_a_failed_prefill_worker_is_fenced_and_the_next_one_fills_the_reservation(engine_loop, receiver, peers,
                                                                                 clock, engine_state):
    async def main():
        remote = remote_prefill(engine_loop, receiver, peers, clock)
        refusing, good = peers.add("p0"), peers.add("p1")
        refusing.prefill = "refuse"
        good.first_token = 9
        retries = []
        outcome = await remote.run("r", prompt(3000), SamplingParams(max_tokens=2, ignore_eos=True),
                                   ["p0", "p1"], lambda: retries.append(1))
        assert outcome.first_token == SampledToken(9) and outcome.num_failures == 1 and retries == [1]
        assert len(refusing.prefill_requests) == len(good.prefill_requests) == 1
        tokens = await decode(engine_loop, remote, "r", outcome.first_token)
        assert tokens[0] == 9 and len(tokens) == 2
        await settle()
        assert refusing.fenced == ["r"] and good.fenced == []   # the worker given up is asked to stop
        assert (await engine_state()).all_free
    asyncio.run(main())


def test_after_the_last_prefill_worker_fails_the_request_is_prefilled_locally(engine_loop, receiver, peers, clock,
                                                                             engine_state):
    async def main():
        remote = remote_prefill(engine_loop, receiver, peers, clock)
        refusing, broken = peers.add("p0"), peers.add("p1")
        refusing.prefill, broken.prefill = "refuse", "transfer_error"
        retries = []
        outcome = await remote.run("r", prompt(4000), SamplingParams(max_tokens=2), ["p0", "p1"],
                                   lambda: retries.append(1))
        assert outcome.first_token is None and outcome.num_failures == 2 and retries == [1]
        await settle()
        assert refusing.fenced == ["r"] and broken.fenced == ["r"]
        assert remote.fences.num_confirmed == 1 and remote.fences.num_waited_out == 0
        assert receiver.num_open() == 0
        assert (await engine_state()).all_free                  # both confirmed: the grant is back
        outputs = await prefill_locally(engine_loop, "r", prompt(4000), max_tokens=2)
        assert outputs[-1].finished and sum(len(o.new_token_ids) for o in outputs) == 2
        assert (await engine_state()).all_free
    asyncio.run(main())


def test_granted_blocks_stay_owned_by_the_transfer_until_the_grant_runs_out(engine_loop, receiver, peers, clock,
                                                                           engine_state):
    async def main():
        remote = remote_prefill(engine_loop, receiver, peers, clock)
        tokens = prompt(5000)
        await prefill_locally(engine_loop, "warm", tokens)      # blocks 0-1 cached here: only block 2 is granted
        remote.threshold_tokens = 8
        worker = peers.add("p0")
        worker.prefill = "transfer_error"
        worker.fence_answers = [False]                          # it cannot say its writes stopped
        outcome = await remote.run("r", tokens, SamplingParams(max_tokens=2), ["p0"], lambda: None)
        assert outcome.first_token is None
        target = worker.prefill_requests[0].target
        assert target.num_cached_blocks == 2 and receiver.grants == [("r", list(target.block_ids[2:]))]
        assert receiver.released == ["r"]
        await settle()
        fenced = await engine_state()
        assert fenced.transfer_owned == ("r",) and fenced.num_fenced_blocks == 1 and fenced.num_used_blocks == 1
        assert fenced.reserved == ()                            # the reservation itself is gone
        clock.advance(TIMEOUT_S + GRANT_GRACE_S - 0.5)          # the grant (and its grace) has not run out
        await settle()
        assert (await engine_state()).num_fenced_blocks == 1
        clock.advance(1.0)
        await settle()
        assert remote.fences.num_waited_out == 1 and remote.fences.num_confirmed == 0
        assert (await engine_state()).all_free
    asyncio.run(main())


def test_the_deadline_ends_the_retries(engine_loop, receiver, peers, clock, engine_state):
    async def main():
        remote = remote_prefill(engine_loop, receiver, peers, clock, timeout_s=5.0)
        slow, spare = peers.add("p0"), peers.add("p1")
        slow.prefill = "refuse"
        slow.on_prefill = lambda: clock.advance(6.0)            # the attempt used the whole deadline
        retries = []
        outcome = await remote.run("r", prompt(6000), SamplingParams(max_tokens=2), ["p0", "p1"],
                                   lambda: retries.append(1))
        assert outcome.first_token is None and outcome.num_failures == 1
        assert spare.prefill_requests == [] and retries == []
        await settle()
        assert slow.fenced == ["r"] and (await engine_state()).all_free
    asyncio.run(main())


def test_a_cancelled_remote_prefill_gives_its_reservation_back(engine_loop, receiver, peers, clock, engine_state):
    async def main():
        remote = remote_prefill(engine_loop, receiver, peers, clock)
        hung = peers.add("p0")
        hung.prefill = "hang"
        task = asyncio.create_task(remote.run("r", prompt(7000), SamplingParams(max_tokens=2), ["p0"],
                                              lambda: None))
        await hung.entered.wait()
        assert (await engine_state()).reserved == ("r",)
        task.cancel()                                           # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        await settle()
        assert hung.fenced == ["r"] and receiver.released == ["r"]
        assert (await engine_state()).all_free
    asyncio.run(main())


async def _sleeping(clock) -> None:
    """Until the code under test waits on the fake clock (its engine calls run on a thread)."""
    await async_wait_until(lambda: clock.num_sleeping, timeout=5, interval=0.01,
                           what="the code under test to wait on the clock")


def test_a_full_pool_waits_for_blocks_then_asks_a_prefill_worker(engine_loop, receiver, peers, clock, engine_state):
    # Prefilling locally at once would stall the running decodes for the whole prompt.
    async def main():
        remote = remote_prefill(engine_loop, receiver, peers, clock)
        worker = peers.add("p0")
        hog = await engine_loop.call(lambda e: e.reserve_remote_prefill("hog", prompt(8000, 200), SamplingParams()))
        assert hog is not None and len(hog.block_ids) == 13     # 11 of 24 blocks left
        task = asyncio.create_task(remote.run("r", prompt(9000, 200), SamplingParams(max_tokens=2), ["p0"],
                                              lambda: None))
        await _sleeping(clock)
        assert worker.prefill_requests == [] and not task.done()
        assert await engine_loop.call(lambda e: e.cancel_remote_prefill("hog"))     # its blocks free
        clock.advance(1.0)
        outcome = await task
        assert outcome.first_token is not None and len(worker.prefill_requests) == 1
        assert len(await decode(engine_loop, remote, "r", outcome.first_token)) == 2
        assert (await engine_state()).all_free
    asyncio.run(main())


def test_a_pool_full_until_the_deadline_means_a_local_prefill(engine_loop, receiver, peers, clock, engine_state):
    async def main():
        remote = remote_prefill(engine_loop, receiver, peers, clock, timeout_s=5.0)
        worker = peers.add("p0")
        hog = await engine_loop.call(lambda e: e.reserve_remote_prefill("hog", prompt(8000, 200), SamplingParams()))
        assert hog is not None
        task = asyncio.create_task(remote.run("r", prompt(9000, 200), SamplingParams(max_tokens=2), ["p0"],
                                              lambda: None))
        while not task.done():
            await _sleeping(clock)
            clock.advance(0.25)
            await async_wait_until(lambda: task.done() or clock.num_sleeping, timeout=5, interval=0.01,
                                   what="the remote prefill to wait on the clock again, or to end")
        outcome = task.result()
        assert outcome.first_token is None and outcome.num_failures == 0
        assert clock.now <= 1000.0 + 5.0 + 0.25
        assert worker.prefill_requests == [] and receiver.num_open() == 0
        assert await engine_loop.call(lambda e: e.cancel_remote_prefill("hog"))
        assert (await engine_state()).all_free
    asyncio.run(main())


def test_a_request_aborted_while_its_prefill_ran_releases_the_filled_blocks(engine_loop, receiver, peers, clock,
                                                                           engine_state):
    async def main():
        remote = remote_prefill(engine_loop, receiver, peers, clock)
        peers.add("p0")
        outcome = await remote.run("r", prompt(10000), SamplingParams(max_tokens=2), ["p0"], lambda: None)
        assert outcome.first_token is not None
        assert await engine_loop.abort_request("r")             # e.g. the frontend's Abort
        assert (await engine_state()).num_fenced_blocks == 3    # a fenced reservation's grant stays out
        with pytest.raises(TransferError, match="lost its reservation"):
            await decode(engine_loop, remote, "r", outcome.first_token)
        assert (await engine_state()).all_free                  # every write had landed: released at once
    asyncio.run(main())
