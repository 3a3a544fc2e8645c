"""Drive a workload through an arrival process against a target, within hard limits.

Decide, then apply: the arrival process fixes when each conversation starts;
the runner only sleeps until then, starts it, and keeps the books. A
conversation's turns run one after another (turn k+1 is built from turn k's
answer); a failed turn ends its conversation.

The run is bounded by construction: it issues at most `max_requests` requests
and none after `duration_s`; once it stops issuing, requests still in flight get
`drain_timeout_s` to finish and are then cancelled (recorded as `cancelled`,
not as server errors); every request also has its own `request_timeout_s`. A
finite workload (a trace) ends the run when it runs out; others start over.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass

import httpx

from splitserve.errors import SplitserveError

from splitserve.loadgen.arrivals import Arrivals, Concurrency
from splitserve.loadgen.client import Target, build_request, make_http_client, monotonic_clock, stream_request, warm_up
from splitserve.loadgen.recorder import Recorder, RequestRecord
from splitserve.loadgen.tokens import PromptVocab
from splitserve.loadgen.workloads import Conversation, Workload

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Limits:
    max_requests: int | None = None
    duration_s: float | None = None
    request_timeout_s: float = 300.0
    drain_timeout_s: float | None = None       # default: request_timeout_s

    def __post_init__(self) -> None:
        if self.max_requests is None and self.duration_s is None:
            raise SplitserveError("a run needs a bound: a request count, a duration, or both")
        if self.max_requests is not None and self.max_requests < 1:
            raise SplitserveError("the request count must be at least 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise SplitserveError("the duration must be positive")

    def describe(self) -> dict:
        return {"max_requests": self.max_requests, "duration_s": self.duration_s,
                "request_timeout_s": self.request_timeout_s, "drain_timeout_s": self.drain}

    @property
    def drain(self) -> float:
        return self.request_timeout_s if self.drain_timeout_s is None else self.drain_timeout_s


class Runner:
    def __init__(self, target: Target, vocab: PromptVocab, workload: Workload, arrivals: Arrivals,
                 limits: Limits, recorder: Recorder | None = None, think_time_s: float = 0.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.target, self.vocab, self.workload = target, vocab, workload
        self.transport = transport
        self.arrivals, self.limits = arrivals, limits
        self.recorder = recorder or Recorder()
        self.think_time_s = think_time_s
        self._num_issued = 0
        self._clock = monotonic_clock()
        self._http: httpx.AsyncClient | None = None

    async def run(self) -> list[RequestRecord]:
        if not self.workload.conversations:
            raise SplitserveError("the workload has no requests")
        source = itertools.cycle(self.workload.conversations) if self.workload.cyclic \
            else iter(self.workload.conversations)
        max_conn = self.arrivals.num_clients if isinstance(self.arrivals, Concurrency) else None
        async with make_http_client(max_conn, transport=self.transport) as http:
            self._http = http
            await warm_up(http, self.target)
            self._clock = monotonic_clock()
            tasks: set[asyncio.Task] = set()
            try:
                if isinstance(self.arrivals, Concurrency):
                    tasks = {asyncio.create_task(self._client_loop(source))
                             for _ in range(self.arrivals.num_clients)}
                else:
                    await self._open_loop(source, tasks)
                await self._drain(tasks)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return sorted(self.recorder.records, key=lambda r: r.request_index)

    # -- issuing ------------------------------------------------------------------------
    def _take(self) -> int | None:
        """The next request's index, or None when the limits say stop. Never awaits."""
        if self.limits.max_requests is not None and self._num_issued >= self.limits.max_requests:
            return None
        if self.limits.duration_s is not None and self._clock() >= self.limits.duration_s:
            return None
        self._num_issued += 1
        return self._num_issued - 1

    async def _open_loop(self, source, tasks: set[asyncio.Task]) -> None:
        for start, conv in self.arrivals.schedule(source):
            if self.limits.duration_s is not None and start >= self.limits.duration_s:
                return
            delay = start - self._clock()
            if delay > 0:
                await asyncio.sleep(delay)
            index = self._take()
            if index is None:
                return
            task = asyncio.create_task(self._conversation(conv, index, start))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _client_loop(self, source) -> None:
        for conv in source:
            index = self._take()
            if index is None:
                return
            await self._conversation(conv, index, None)

    async def _drain(self, tasks: set[asyncio.Task]) -> None:
        """Wait for in-flight work; past the duration, give it `drain` seconds, then cancel it."""
        while tasks:
            timeout = None
            if self.limits.duration_s is not None:
                timeout = max(0.0, self.limits.duration_s + self.limits.drain - self._clock())
            done, _ = await asyncio.wait(set(tasks), timeout=timeout)
            tasks.difference_update(done)
            if timeout is not None and not done:
                log.info("run time is up: cancelling %d in-flight conversation(s)", len(tasks))
                return       # run() cancels what is left

    # -- one conversation ---------------------------------------------------------------
    async def _conversation(self, conv: Conversation, first_index: int, scheduled: float | None) -> None:
        """Run `conv`'s turns in order; its first request index is already taken."""
        history: list[tuple[str, str]] = []
        for index, turn in enumerate(conv.turns):
            request_index = first_index
            if index > 0:
                if self.think_time_s > 0:
                    await asyncio.sleep(self.think_time_s)
                request_index = self._take()
                if request_index is None:
                    return
            prepared = build_request(self.target, self.vocab, history, turn.text, turn.max_tokens)
            record = RequestRecord(request_index=request_index, conversation_id=conv.conversation_id,
                                   turn=index, max_tokens=turn.max_tokens, group=conv.group,
                                   num_prompt_tokens=prepared.num_prompt_tokens,
                                   scheduled_s=scheduled if index == 0 else None)
            self.recorder.started(record)
            try:
                await stream_request(self._http, self.target, prepared, record, self._clock,
                                     self.limits.request_timeout_s, self.vocab)
            finally:
                self.recorder.finished(record)
            if not record.ok:
                return
            history.append((turn.text, record.output_text))


def run_workload(target: Target, vocab: PromptVocab, workload: Workload, arrivals: Arrivals,
                 limits: Limits, recorder: Recorder | None = None, think_time_s: float = 0.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> list[RequestRecord]:
    """Synchronous entry point: one run in a fresh event loop."""
    runner = Runner(target, vocab, workload, arrivals, limits, recorder, think_time_s, transport)
    return asyncio.run(runner.run())
