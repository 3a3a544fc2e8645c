"""Rank 0's control channel to the other tensor-parallel ranks: work that is not per step.

The per-step path is the `ForwardBatch` broadcast (tensor_parallel.py). Some work
is not per step and must still run inside a child rank's own process: a KV
connector per rank is created there and registers that rank's KV pool (each
process registers its own memory, the way NIXL deployments register each GPU),
then reserves, releases and reports transfers. That goes over one duplex pipe
per rank: a pipe created at spawn for a local child rank, or a TCP connection for a
rank started on its own (rendezvous.py); both are multiprocessing Connections:

- rank 0 `call`s a module-level function `fn(ctx, *args)` on a rank and waits
  for its return value (the child's exception is re-raised on rank 0), or
  `post`s it without waiting;
- a child `emit`s events (a transfer finished) that rank 0 hands to one handler.

A thread in each child serves its pipe, so a control call never waits for a
forward step; one thread per pipe on rank 0 dispatches replies and events as they
arrive. Functions travel by reference (pickle), so the engine does not depend on
what runs over the channel (the worker's KV transfer does). The event handler
runs on a reader thread: it must not `call` (that would wait for its own thread).
A rank whose connection closes before `close()` is lost: its pending calls fail and
`on_lost(rank, why)` is told (tensor_parallel.py then gives the whole group up).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from splitserve.errors import FatalError

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.model.forward_batch import LayerReport
from splitserve.services.engine.kv_cache import KVCache

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0

LayerHook = Callable[[list[LayerReport]], Callable[[int], None] | None]


class RankControlError(FatalError):
    """A child rank did not answer a control call (it died, or the call timed out)."""


@dataclass(slots=True)
class RankContext:
    """What a control call sees in a child rank's process."""

    rank: int
    world_size: int
    config: EngineConfig
    kv: KVCache
    emit: Callable[[object], None]            # send an event to rank 0's handler
    layer_hook: LayerHook | None = None       # per step: the callback for the step's layer reports
    attachment: object | None = None          # state the control calls installed (the KV transfer)
    host: str | None = None                   # where this rank's connector listens (None: as rank 0's)
    advertise_host: str | None = None         # the address its peers dial (None: host)
    closers: list[Callable[[], None]] = field(default_factory=list)   # run when the rank exits


@dataclass(slots=True)
class _Call:
    seq: int                 # 0: no reply wanted
    fn: Callable
    args: tuple


@dataclass(slots=True)
class _Reply:
    seq: int
    value: object = None
    error: BaseException | None = None


@dataclass(slots=True)
class _Event:
    value: object


class RankControl:
    """Rank 0's end of every other rank's control connection."""

    def __init__(self, conns: dict[int, Connection], on_lost: Callable[[int, str], None] | None = None):
        self._conns = conns
        self._on_lost = on_lost
        self._closing = False
        self._send_locks = {rank: threading.Lock() for rank in conns}
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[int, concurrent.futures.Future]] = {}   # seq → (rank, future)
        self._lost: dict[int, str] = {}
        self._any_lost = threading.Event()
        self._seq = itertools.count(1)
        self._handler: Callable[[int, object], None] | None = None
        self._readers = [threading.Thread(target=self._read, args=(rank, conn), daemon=True,
                                          name=f"tp-control-rank{rank}") for rank, conn in conns.items()]
        for reader in self._readers:
            reader.start()

    @property
    def ranks(self) -> list[int]:
        return sorted(self._conns)

    def set_event_handler(self, handler: Callable[[int, object], None] | None) -> None:
        """`handler(rank, event)` for every event a child emits (on a reader thread)."""
        self._handler = handler

    def call(self, rank: int, fn: Callable, *args, timeout_s: float = CALL_TIMEOUT_S):
        """Run `fn(ctx, *args)` on `rank`; its result, or its exception re-raised here."""
        future = self._start(rank, fn, args)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise RankControlError(f"tensor-parallel rank {rank} did not answer {fn.__name__} "
                                   f"within {timeout_s:.0f} s") from None

    def call_all(self, fn: Callable, *args, timeout_s: float = CALL_TIMEOUT_S) -> list:
        """`call` on every child rank at once; results in rank order. After every reply
        arrived (or timed out), raises the first rank's error, if any."""
        futures = [self._start(rank, fn, args) for rank in self.ranks]
        done, _ = concurrent.futures.wait(futures, timeout_s)
        results, first_error = [], None
        for rank, future in zip(self.ranks, futures):
            if future not in done:
                future.cancel()
                error: BaseException | None = RankControlError(
                    f"tensor-parallel rank {rank} did not answer {fn.__name__} within {timeout_s:.0f} s")
            else:
                error = future.exception()
            first_error = first_error or error
            results.append(None if error is not None else future.result())
        if first_error is not None:
            raise first_error
        return results

    def post(self, rank: int, fn: Callable, *args) -> None:
        """Run `fn(ctx, *args)` on `rank` without waiting; failures are logged there."""
        self._send(rank, _Call(0, fn, args))

    def post_all(self, fn: Callable, *args) -> None:
        for rank in self.ranks:
            try:
                self.post(rank, fn, *args)
            except RankControlError as error:
                log.warning("%s", error)

    def close(self) -> None:
        self._closing = True
        for conn in self._conns.values():
            conn.close()
        for reader in self._readers:
            reader.join(5)

    # -- internals -------------------------------------------------------------------------
    def _start(self, rank: int, fn: Callable, args: tuple) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        seq = next(self._seq)
        with self._lock:
            self._pending[seq] = (rank, future)
        try:
            self._send(rank, _Call(seq, fn, args))
        except RankControlError as error:
            with self._lock:
                self._pending.pop(seq, None)
            future.set_exception(error)
        return future

    def _send(self, rank: int, message: _Call) -> None:
        lost = self._lost.get(rank)
        if lost is not None:
            raise RankControlError(f"tensor-parallel rank {rank} is gone ({lost})")
        try:
            with self._send_locks[rank]:
                self._conns[rank].send(message)
        except (OSError, ValueError) as error:
            raise RankControlError(f"tensor-parallel rank {rank}: control pipe broken ({error})") from None

    def _read(self, rank: int, conn: Connection) -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError) as error:
                self._lose(rank, str(error) or "its control connection closed")
                return
            if isinstance(message, _Reply):
                with self._lock:
                    rank_future = self._pending.pop(message.seq, None)
                if rank_future is None:
                    continue
                future = rank_future[1]
                if future.cancelled():
                    continue
                if message.error is not None:
                    future.set_exception(message.error)
                else:
                    future.set_result(message.value)
            elif isinstance(message, _Event) and self._handler is not None:
                try:
                    self._handler(rank, message.value)
                except Exception:          # a handler bug must not stop the replies
                    log.exception("tensor-parallel rank %d: event handler failed", rank)

    def wait_lost(self, timeout_s: float) -> bool:
        """Whether some rank is gone, waiting up to `timeout_s` for its connection to close."""
        return self._any_lost.wait(timeout_s)

    def _lose(self, rank: int, why: str) -> None:
        self._lost[rank] = why
        self._any_lost.set()
        with self._lock:
            lost = [(seq, f) for seq, (r, f) in self._pending.items() if r == rank]
            for seq, _ in lost:
                del self._pending[seq]
        for _, future in lost:
            if not future.done():
                future.set_exception(RankControlError(f"tensor-parallel rank {rank} is gone ({why})"))
        if self._on_lost is not None and not self._closing:
            try:
                self._on_lost(rank, why)
            except Exception:
                log.exception("tensor-parallel rank %d: the lost-rank handler failed", rank)


def serve_control(conn: Connection, ctx: RankContext) -> threading.Thread:
    """Child side: a thread that runs rank 0's calls in order until the pipe closes."""
    lock = threading.Lock()

    def send(message) -> None:
        with lock:
            try:
                conn.send(message)
            except (pickle.PicklingError, TypeError, AttributeError) as error:
                if not isinstance(message, _Reply):
                    raise
                conn.send(_Reply(message.seq, None, RankControlError(
                    f"rank {ctx.rank}: unpicklable result of a control call: {error!r}")))

    def emit(value: object) -> None:
        try:
            send(_Event(value))
        except (OSError, ValueError):
            log.warning("tensor-parallel rank %d: rank 0 is gone; event dropped", ctx.rank)

    def serve() -> None:
        while True:
            try:
                message: _Call = conn.recv()
            except (EOFError, OSError):
                return
            try:
                value, error = message.fn(ctx, *message.args), None
            except Exception as exc:          # reported to the caller, never fatal for the rank
                value, error = None, exc
                if not message.seq:
                    log.warning("tensor-parallel rank %d: %s failed: %s", ctx.rank,
                                getattr(message.fn, "__name__", message.fn), exc)
            if message.seq:
                try:
                    send(_Reply(message.seq, value, error))
                except (OSError, ValueError):
                    return

    ctx.emit = emit
    thread = threading.Thread(target=serve, name=f"tp-control-rank{ctx.rank}", daemon=True)
    thread.start()
    return thread
