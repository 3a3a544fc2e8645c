"""EngineLoop: one real engine (the built-in one) on its own thread, driven from asyncio.

Jobs run on the engine thread, in the order they were queued; a failing job raises
in its caller and the loop carries on; a request's outputs arrive as a stream that
an abort (or the caller leaving) ends; a failing step fails every open stream and
the loop carries on; stop() fails what is open and later calls get
EngineStoppedError. Every test ends with the engine idle. Nothing here sleeps: each
step waits on the loop's own answers.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from splitserve.errors import InvalidRequestError
from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.builtin import BuiltinEngine
from splitserve.services.engine.sequence import FinishReason
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.services.worker.engine_loop import EngineLoop, EngineStepError, EngineStoppedError

from .conftest import assert_engine_idle

PROMPT = list(range(100, 140))


@pytest.fixture
def loop(engine):
    loop = EngineLoop(engine)
    loop.start()
    try:
        yield loop
    finally:
        loop.stop()
    assert not loop.alive
    assert_engine_idle(engine)


def _add(request_id: str, max_tokens: int):
    return lambda e: e.add_request(request_id, PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def _collect(loop: EngineLoop, request_id: str, max_tokens: int) -> list:
    return [out async for out in loop.stream(request_id, _add(request_id, max_tokens))]


def test_jobs_run_on_the_engine_thread_in_the_order_queued(loop, engine):
    seen: list[tuple[int, str]] = []

    def job(i: int):
        def run(e):
            assert e is engine
            seen.append((i, threading.current_thread().name))
            return i
        return run

    async def main():
        for i in range(3):
            loop.post(job(i))                     # fire and forget, queued first
        return await asyncio.gather(*(loop.call(job(i)) for i in range(3, 8)))

    assert asyncio.run(main()) == [3, 4, 5, 6, 7]
    assert [i for i, _ in seen] == list(range(8))
    assert {name for _, name in seen} == {"engine-loop"}


def test_a_failing_job_raises_in_its_caller_and_the_loop_carries_on(loop):
    def broken(_engine):
        raise ValueError("bad job")

    async def main():
        with pytest.raises(ValueError, match="bad job"):
            await loop.call(broken)
        loop.post(broken)                         # logged, dropped
        assert await loop.call(lambda e: e.has_unfinished()) is False
        return await _collect(loop, "after-failure", 3)

    outputs = asyncio.run(main())
    assert sum(len(o.new_token_ids) for o in outputs) == 3
    assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.LENGTH
    assert not any(o.finished for o in outputs[:-1])
    assert loop.alive


def test_a_request_that_cannot_start_fails_its_stream_only(loop):
    async def main():
        with pytest.raises(InvalidRequestError, match="empty"):
            async for _ in loop.stream("bad", lambda e: e.add_request("bad", [], SamplingParams())):
                pass
        return await _collect(loop, "good", 2)

    outputs = asyncio.run(main())
    assert outputs[-1].finished and sum(len(o.new_token_ids) for o in outputs) == 2


def test_abort_ends_the_stream_with_an_abort_output(loop):
    async def main():
        stream = loop.stream("long", _add("long", 500))
        first = await anext(stream)
        assert await loop.abort_request("long") is True
        rest = [out async for out in stream]
        return first, rest, await loop.abort_request("long")

    first, rest, again = asyncio.run(main())
    assert first.new_token_ids and not first.finished
    assert rest[-1].finished and rest[-1].finish_reason is FinishReason.ABORT
    assert sum(len(o.new_token_ids) for o in [first, *rest]) < 500
    assert again is False                         # the engine no longer knows it


def test_leaving_the_stream_early_aborts_the_request(loop, engine):
    async def main():
        stream = loop.stream("left", _add("left", 500))
        await anext(stream)
        await stream.aclose()                     # the caller went away: an abort is queued
        # Jobs run in order: the abort has run by the time this one does.
        return await loop.call(lambda e: (e.has_unfinished(), e.load().counters.num_aborted))

    aborted_before = engine.load().counters.num_aborted
    unfinished, aborted = asyncio.run(main())
    assert unfinished is False and aborted == aborted_before + 1


def test_a_stream_whose_event_loop_closed_is_aborted_and_the_loop_carries_on(loop, engine):
    """A reader whose event loop closed without closing its stream: the engine thread must not
    die delivering to it (call_soon_threadsafe raises there); the request is aborted instead."""
    reader = asyncio.new_event_loop()
    reader.run_until_complete(asyncio.wait_for(anext(loop.stream("orphan", _add("orphan", 500))), 30))
    reader.close()                                 # no shutdown_asyncgens: the stream stays open
    after = asyncio.run(asyncio.wait_for(_collect(loop, "after", 3), 30))    # a dead engine thread: times out
    assert loop.alive and len(after) >= 1 and after[-1].finished
    assert asyncio.run(loop.call(lambda e: e.core.scheduler.find("orphan"))) is None
    assert_engine_idle(engine)


def test_a_failing_step_fails_every_open_stream_and_the_loop_carries_on(loop, engine, monkeypatch):
    real_step = engine.step
    failures = []

    def step_failing_once():
        if not failures:
            failures.append(True)
            raise RuntimeError("device fault")
        return real_step()

    monkeypatch.setattr(engine, "step", step_failing_once)

    async def main():
        results = await asyncio.gather(_collect(loop, "a", 4), _collect(loop, "b", 4), return_exceptions=True)
        return results, await _collect(loop, "after", 2)

    results, after = asyncio.run(main())
    assert [type(r) for r in results] == [EngineStepError, EngineStepError], results
    assert "device fault" in str(results[0])
    assert after[-1].finished and sum(len(o.new_token_ids) for o in after) == 2


class _LostGroup:
    """Stands in for the engine's TensorParallelGroup: records what `step_failed` was told."""

    def __init__(self):
        self.lost: list[str] = []

    def step_failed(self, exc: BaseException) -> None:
        self.lost.append(str(exc))


def test_a_failing_tensor_parallel_step_loses_the_group_and_stops_the_loop(engine, monkeypatch):
    """With tensor parallelism a failed step may leave the ranks out of step: the open
    streams fail as on a shutdown (UNAVAILABLE, migrated), the group is told it is lost,
    and the loop takes no more work."""
    group = _LostGroup()
    monkeypatch.setattr(engine.core, "tp", group)

    def failing_step():
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(engine, "step", failing_step)
    loop = EngineLoop(engine)
    loop.start()

    async def main():
        results = await asyncio.gather(_collect(loop, "a", 4), _collect(loop, "b", 4), return_exceptions=True)
        await asyncio.to_thread(loop._thread.join, 10)       # the loop ends by itself
        with pytest.raises(EngineStoppedError):
            await loop.call(lambda e: None)
        return results

    results = asyncio.run(main())
    loop.stop()
    assert {type(r) for r in results} == {EngineStoppedError}, results
    assert "tensor-parallel group is lost" in str(results[0])
    assert len(group.lost) == 1 and "Connection closed by peer" in group.lost[0]
    assert not loop.alive
    assert_engine_idle(engine)


def test_stop_fails_open_streams_and_later_calls(engine):
    loop = EngineLoop(engine)
    loop.start()

    async def main():
        stream = loop.stream("open", _add("open", 500))
        await anext(stream)
        await asyncio.to_thread(loop.stop)       # joins the engine thread
        with pytest.raises(EngineStoppedError):
            async for _ in stream:
                pass
        with pytest.raises(EngineStoppedError):
            await loop.call(lambda e: None)
        with pytest.raises(EngineStoppedError):
            await anext(loop.stream("late", _add("late", 2)))
        loop.abort("late")                        # fire and forget on a stopped loop: a no-op
        loop.post(lambda e: None)

    asyncio.run(main())
    assert not loop.alive
    assert_engine_idle(engine)


class StoreStandIn:
    """A SharedStore (kv_tiers/shared_store.py) without a store process: what it "took" is
    said by the test, from another thread, as the real client's publisher thread does."""

    round_trip_s = 1e-3
    occupancy = (0, 0)

    def __init__(self) -> None:
        self.on_events = None
        self.published: list[bytes] = []
        self._events: list[tuple[str, tuple[bytes, ...]]] = []
        self._lock = threading.Lock()

    def lookup(self, block_hashes):
        return 0

    def fetch(self, block_hashes, block_ids, pool):
        return 0

    def publish(self, pool, blocks):
        self.published.extend(h for _, h in blocks)

    def take_events(self):
        with self._lock:
            events, self._events = self._events, []
        return events

    def took(self, hashes: tuple[bytes, ...]) -> None:
        with self._lock:
            self._events.append(("stored", hashes))
        if self.on_events is not None:
            self.on_events()

    def rejections(self):
        return {}

    def close(self) -> None:
        pass


def test_the_stores_events_reach_subscribers_while_the_engine_is_idle(llama_dir):
    engine = BuiltinEngine.start(EngineConfig(model=str(llama_dir), num_kv_blocks=24, num_threads=1))
    store = StoreStandIn()
    engine.core.attach_store(store)
    delivered = threading.Event()
    seen: list = []

    def subscriber(events):
        seen.extend(events)
        if any(getattr(e, "tier", "") == "store" and e.block_hashes for e in events):
            delivered.set()

    engine.subscribe_events(subscriber)
    loop = EngineLoop(engine)
    loop.start()
    try:
        assert asyncio.run(_collect(loop, "r", 2))[-1].finished
        assert store.published                        # the prompt's full blocks, offered after the step
        assert not engine.has_unfinished()            # idle: no step will come
        # The store acknowledges after the engine's last step (its publisher thread).
        threading.Thread(target=store.took, args=(tuple(store.published),)).start()
        assert delivered.wait(10), seen
        stored = [e for e in seen if getattr(e, "tier", "") == "store"]
        assert stored[-1].block_hashes == tuple(store.published)
    finally:
        loop.stop()
        engine.close()
