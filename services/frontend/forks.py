"""Several samples of one prompt (n > 1, best_of) as one worker request.

The frontend sends the n choices of a prompt as one TokenGenerateRequest with `n`: the
worker prefills the prompt once and forks it (its samples share the prompt's KV blocks),
and tags each message with its choice. `ForkedCall` is that one call, demultiplexed:
each choice reads its own inbox through `Frontend.generate` (core.py), which turns the
messages into that choice's deltas exactly as for a request of its own, so the HTTP
responses are those of n separate requests.

The first attempt of every choice is this shared call. When its stream breaks, each
unfinished choice continues on its own (migration.py: its prompt plus its own output so
far, its own seed), like any single request; choices that had finished are unaffected.
A choice that ends before the worker's sample does (a stop string, the client closing
one choice) stops that sample alone (a session abort of "<request_id>/<i>"); once every
choice is done the call is closed, which aborts whatever the worker still runs of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from splitserve.proto.v1 import worker_pb2
from splitserve.services.frontend.generation_request import GenerationRequest
from splitserve.services.frontend.migration import Progress
from splitserve.services.frontend.workers.session import WorkerCallError

if TYPE_CHECKING:
    from splitserve.services.frontend.request_tracing import RequestTrace
    from splitserve.services.frontend.routing import Route

log = logging.getLogger(__name__)

ENDED = None      # an inbox's item: the call ended without this choice's `finished` message


class RouteFinished(Protocol):
    def on_finished(self, request_id: str) -> None: ...


class Frontend(Protocol):
    """What a forked call needs of the frontend (core.py's `Frontend`)."""

    router: RouteFinished

    async def route(self, req: GenerationRequest, progress: Progress) -> Route: ...

    def add_prefill_peers(self, message: worker_pb2.TokenGenerateRequest, route: Route) -> None: ...


@dataclass(slots=True, eq=False)
class ForkedCall:
    """One worker call for the choices `reqs` of one prompt (choice i is reqs[i])."""

    reqs: list[GenerationRequest]
    inboxes: list[asyncio.Queue] = field(default_factory=list)
    route: Route | None = None
    failure: BaseException | None = None     # the routing's refusal, for every choice
    finished: list[bool] = field(default_factory=list)     # the worker finished sample i
    released: set[int] = field(default_factory=set)        # choices done reading
    _starting: asyncio.Lock = field(default_factory=asyncio.Lock)
    _pump: asyncio.Task | None = None
    _aborts: set[asyncio.Task] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.inboxes = [asyncio.Queue() for _ in self.reqs]
        self.finished = [False] * len(self.reqs)

    @property
    def request_id(self) -> str:
        return self.reqs[0].request_id

    def sample_id(self, choice: int) -> str:
        """The worker's id of one sample (services/worker/service.py fork_id)."""
        return f"{self.request_id}/{choice}"

    async def start(self, frontend: Frontend, progress: Progress, trace: RequestTrace | None = None) -> Route:
        """Route the call and start it, once for every choice; raises the routing's refusal.
        `trace`: the spans of the choice that starts it, which the worker's spans join."""
        async with self._starting:
            if self.failure is not None:
                raise self.failure
            if self.route is None:
                try:
                    routing = frontend.route(self.reqs[0], progress)
                    self.route = await (routing if trace is None else trace.route(routing))
                except BaseException as exc:
                    self.failure = exc
                    raise
                first = self.reqs[0]
                message = Progress(first.request_id, first.prompt_ids, first.params).worker_request()
                message.n = len(self.reqs)
                frontend.add_prefill_peers(message, self.route, first.prefill_address)
                if trace is not None:
                    trace.carry(message)
                log.info("request %s: %d samples of %d prompt tokens -> %s (%s)", message.request_id,
                         message.n, len(message.token_ids), self.route.decode.worker_id, self.route.reason)
                self._pump = asyncio.ensure_future(self._read(frontend, message))
            return self.route

    async def _read(self, frontend: Frontend, message: worker_pb2.TokenGenerateRequest) -> None:
        """Hand each worker message to its choice's inbox; a break goes to every inbox."""
        end: WorkerCallError | None = None
        try:
            async with contextlib.aclosing(self.route.decode.generate(message)) as responses:
                async for resp in responses:
                    if resp.choice >= len(self.inboxes):
                        continue           # not a sample of ours (a confused worker)
                    self.finished[resp.choice] = self.finished[resp.choice] or resp.finished
                    self.inboxes[resp.choice].put_nowait(resp)
        except WorkerCallError as exc:
            end = exc
        finally:
            frontend.router.on_finished(message.request_id)
        for choice, inbox in enumerate(self.inboxes):
            if not self.finished[choice]:
                inbox.put_nowait(end if end is not None else ENDED)

    def release(self, choice: int) -> None:
        """Choice `choice` reads no more: stop its sample if the worker still runs it, and close
        the call once no choice reads it."""
        if choice in self.released:
            return
        self.released.add(choice)
        route = self.route
        if route is not None and not self.finished[choice] and len(self.released) < len(self.reqs):
            task = asyncio.ensure_future(route.decode.abort_sample(self.sample_id(choice)))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)
        if len(self.released) == len(self.reqs):
            self.close()

    def close(self) -> None:
        """Cancel the call (the session aborts the worker's request if it still runs)."""
        if self._pump is not None and not self._pump.done():
            self._pump.cancel()


def forkable(reqs: list[GenerationRequest]) -> bool:
    """True when the choices are samples of one request: the same prompt and parameters but
    for the seed, which is seed + i for choice i (or unset for all) — what the worker forks."""
    first = reqs[0]
    for i, r in enumerate(reqs):
        seed = None if first.params.seed is None else first.params.seed + i
        if r.prompt_ids != first.prompt_ids or replace(first.params, seed=seed) != r.params:
            return False
    return True
