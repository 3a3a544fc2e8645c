"""Rank 0's control pipe to a child rank: calls, posts, events and a rank that dies.

A real child process (forked, so the test needs no importable helper module) serves
the pipe with `serve_control`; the calls are stdlib callables run as `fn(ctx, *args)`.
"""

from __future__ import annotations

import multiprocessing as mp
import operator
import threading

import pytest
import torch

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.kv_cache import KVCache
from splitserve.services.engine.parallel.rank_control import RankContext, RankControl, RankControlError, serve_control


def _child(conn) -> None:
    kv = KVCache(1, 2, 4, 1, 2, torch.float32, torch.device("cpu"))
    ctx = RankContext(1, 2, EngineConfig(model="unused", tensor_parallel_size=2), kv, emit=lambda _: None)
    serve_control(conn, ctx).join()


@pytest.fixture
def child():
    ctx = mp.get_context("fork")
    parent_end, child_end = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_child, args=(child_end,), daemon=True)
    proc.start()
    child_end.close()
    control = RankControl({1: parent_end})
    try:
        yield control, proc
    finally:
        proc.kill()
        proc.join(10)
        control.close()


def test_calls_posts_and_events(child):
    control, _ = child
    assert control.ranks == [1]
    assert control.call(1, getattr, "rank") == 1
    assert control.call_all(getattr, "world_size") == [2]
    with pytest.raises(AttributeError):                       # the child's exception, re-raised here
        control.call(1, getattr, "no_such_field")
    with pytest.raises(RankControlError, match="unpicklable"):
        control.call(1, getattr, "emit")                       # a closure cannot come back
    control.post(1, setattr, "attachment", 42)                 # posts run in order with later calls
    assert control.call(1, getattr, "attachment") == 42

    events: list[tuple[int, object]] = []
    arrived = threading.Event()
    control.set_event_handler(lambda rank, event: (events.append((rank, event)), arrived.set()))
    control.call(1, operator.methodcaller("emit", "hello"))
    assert arrived.wait(10) and events == [(1, "hello")]


def test_a_dead_rank_fails_calls_at_once(child):
    control, proc = child
    assert control.call(1, getattr, "rank") == 1
    assert not control.wait_lost(0.05)                         # alive: a failed step is its own
    proc.kill()
    assert control.wait_lost(10)                               # what a failed step waits for
    proc.join(10)
    with pytest.raises(RankControlError, match="rank 1"):
        control.call(1, getattr, "rank", timeout_s=10)
    with pytest.raises(RankControlError):
        control.call_all(getattr, "rank", timeout_s=10)
    control.post_all(setattr, "attachment", 1)                 # logged, not raised


def _watched_child(on_lost):
    ctx = mp.get_context("fork")
    parent_end, child_end = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_child, args=(child_end,), daemon=True)
    proc.start()
    child_end.close()
    return RankControl({1: parent_end}, on_lost=on_lost), proc


def test_a_dead_rank_is_reported_once_and_closing_is_not():
    lost: list[int] = []
    reported = threading.Event()
    control, proc = _watched_child(lambda rank, why: (lost.append(rank), reported.set()))
    try:
        assert control.call(1, getattr, "rank") == 1
        proc.kill()
        proc.join(10)
        assert reported.wait(10) and lost == [1]
        with pytest.raises(RankControlError, match="rank 1 is gone"):
            control.call(1, getattr, "rank")
    finally:
        control.close()
    # A control closed on purpose reports nothing, though its rank's end goes away then.
    quiet: list[int] = []
    control, proc = _watched_child(lambda rank, why: quiet.append(rank))
    assert control.call(1, getattr, "rank") == 1
    control.close()
    proc.kill()
    proc.join(10)
    assert quiet == []
