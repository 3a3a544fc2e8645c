"""One engine (services/engine_api/contract.py) on its own thread, driven by a queue of jobs from asyncio callers.

The engine is synchronous and not thread-safe (STYLE: "the engine loop is
synchronous"), so exactly one thread ever touches it: this loop. Callers on
the asyncio side never call the engine; they queue a job (a function of the
engine) and await its result, or open an output stream for a request. The loop
runs every queued job between steps, so an abort takes effect before the next
step and its blocks are free by then.

Per-request failures (bad token ids, a duplicate id) surface as that stream's
exception. A failing `step()` is not attributable to one request: every
request in the engine is aborted and told, and the loop carries on; with tensor
parallelism the group is lost instead and the loop stops (`_lose_group`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from splitserve.errors import FatalError
from splitserve.services.engine_api.contract import Engine
from splitserve.services.worker_protocol.outputs import RequestOutput

log = logging.getLogger(__name__)

T = TypeVar("T")


class EngineStepError(FatalError):
    """The engine failed while stepping a batch; the requests in it were aborted."""


class EngineStoppedError(FatalError):
    """The worker is shutting down."""


@dataclass(slots=True)
class _Stream:
    """Where one request's outputs go: an asyncio queue fed from the engine thread."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> bool:
        """False when the reader's event loop is closed: nobody can read this stream any more."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:            # "Event loop is closed"
            return False
        return True


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}    # engine thread only
        self._flush = False                       # an abort queued an output: step once
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        # The shared store's events reach the router between steps, not at the next request.
        engine.wake_on_store_events(lambda: self._jobs.put(engine.flush_store_events))

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the current step, fail every open stream, and join the thread."""
        self._stopping.set()
        self._jobs.put(lambda: None)               # wake an idle loop
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- what asyncio callers use --------------------------------------------------
    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(self.engine))
            except BaseException as exc:   # handed to the caller, never kills the loop
                future.set_exception(exc)

        self._submit(job)
        return await asyncio.wrap_future(future)

    async def stream(self, request_id: str, start: Callable[[Engine], list[RequestOutput] | None],
                     siblings: list[str] = ()) -> AsyncIterator[RequestOutput]:
        """Run `start(engine)` (which adds the request) and yield the request's outputs.

        `start` may return outputs it produced itself (complete_remote_prefill
        does). The last output yielded has `finished` set. Leaving the iteration
        early (the caller was cancelled, or stopped reading) aborts the request,
        so its blocks are freed by the next step. `siblings`: the ids of the request's
        forks (n > 1), whose outputs come on this stream too; it ends once every one
        has finished, and leaving early aborts those that have not.
        """
        ids = [request_id, *siblings]
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())

        def job() -> None:
            try:
                outputs = start(self.engine) or []
            except Exception as exc:
                stream.put(exc)
                return
            for rid in ids:
                self._streams[rid] = stream
            self._dispatch(outputs)

        self._submit(job)
        unfinished = set(ids)
        try:
            while unfinished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    unfinished.clear()      # start failed, or every stream was failed (and aborted)
                    raise item
                if item.finished:
                    unfinished.discard(item.request_id)
                yield item
        finally:
            for rid in unfinished:
                self.abort(rid)

    def post(self, fn: Callable[[Engine], object]) -> None:
        """Run `fn(engine)` on the engine thread between steps (fire and forget; safe to
        call from a cancelled coroutine). Its result is dropped, its exception logged."""
        if not self._stopping.is_set():
            self._jobs.put(lambda: fn(self.engine))

    def abort(self, request_id: str) -> None:
        """Drop a request (fire and forget). An open stream gets a final ABORT output."""
        if not self._stopping.is_set():     # a stopping loop fails every stream itself
            self._jobs.put(lambda: self._abort(request_id))

    async def abort_request(self, request_id: str) -> bool:
        """`abort`, awaited: False when the engine did not know the request."""
        return await self.call(lambda _engine: self._abort(request_id))

    # -- the engine thread ----------------------------------------------------------
    def _submit(self, job: Callable[[], None]) -> None:
        if self._stopping.is_set():
            raise EngineStoppedError("the worker is shutting down")
        self._jobs.put(job)

    def _run(self) -> None:
        log.info("engine loop started")
        while not self._stopping.is_set():
            busy = self.engine.has_unfinished() or self._flush
            self._run_jobs(block=not busy)
            if self.engine.has_unfinished() or self._flush:
                self._flush = False
                self._step()
        self._fail_all(EngineStoppedError("the worker is shutting down"))
        log.info("engine loop stopped")

    def _run_jobs(self, block: bool) -> None:
        try:
            job = self._jobs.get() if block else self._jobs.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                job()
            except Exception:
                log.exception("engine job failed")
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            if self.engine.ranks is not None:
                self._lose_group(exc)
                return
            log.exception("engine step failed; aborting its %d requests", len(self._streams))
            self._fail_all(EngineStepError(f"the engine failed on this batch: {exc}"))
            return
        self._dispatch(outputs)

    def _lose_group(self, exc: Exception) -> None:
        """A tensor-parallel step failed: the ranks may be out of step in their collectives
        (or one is gone), so the group cannot step again. The loop stops, and its requests
        fail as on a shutdown (UNAVAILABLE: their frontends migrate them); the group's
        watchers (server.py) make the worker exit."""
        log.exception("tensor-parallel step failed; the group is lost, failing its %d requests",
                      len(self._streams))
        self._stopping.set()
        self._fail_all(EngineStoppedError(f"the tensor-parallel group is lost: {exc}"))
        self.engine.ranks.step_failed(exc)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue        # aborted by its caller, or added without a stream
            if out.finished:
                del self._streams[out.request_id]
            if not stream.put(out) and not out.finished:
                # Its reader's event loop is gone (it never closed the stream): stop generating.
                del self._streams[out.request_id]
                self.engine.abort(out.request_id)

    def _abort(self, request_id: str) -> bool:
        if not self.engine.abort(request_id):
            return False
        self._flush = True     # the ABORT output reaches an open stream on the next step
        return True

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("abort of request %s failed", request_id)
            stream.put(exc)
