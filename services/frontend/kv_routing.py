"""The frontend's glue to splitserve.router: policies over the WorkerPool, KV events, discovery.

`PolicyRouter` implements the frontend's `Router` interface (routing.py) with
a `RouterCore` (index + load + one policy per leg). It owns three kinds of
background tasks, all cancelled by `close()`:

- one KvEvents subscriber per worker once the worker has described itself
  (its block size and block-hash extra key come from Describe), so a frontend
  that starts or restarts builds its index from the workers alone;
- a Stats poller that corrects the load model from the workers' own figures
  (and drops lapsed routing predictions from the index);
- a reconciler that adds and removes pool workers as the registry (static or
  etcd) changes. When etcd is unreachable the registry keeps its last members,
  so routing carries on with them.

The pool's own health watch still decides readiness; the reconciler only adds
handles (with the pool's watch task) and removes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from splitserve.proto.v1 import worker_pb2
from splitserve.router.core import RouteDecision, RouterCore, WorkerSpec
from splitserve.router.discovery import WorkerRecord
from splitserve.router.policies import DEFAULT_PREFILL_WEIGHT
from splitserve.router.subscriber import EventSubscriber

from splitserve.services.frontend.routing import Route, RouteRequest
from splitserve.services.frontend.workers.pool import WorkerHandle, WorkerPool

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.5
STATS_TIMEOUT_S = 2.0
RECONCILE_INTERVAL_S = 0.5


class PolicyRouter:
    def __init__(self, pool: WorkerPool, core: RouterCore, registry=None, subscribe: bool = True):
        self.pool = pool
        self.core = core
        self.registry = registry
        self.subscribe = subscribe
        self.subscribers: dict[str, EventSubscriber] = {}     # by worker address
        self._sub_tasks: dict[str, asyncio.Task] = {}
        self._watch_tasks: dict[str, asyncio.Task] = {}
        self._tasks: list[asyncio.Task] = []
        # Called with (worker_id, StatsResponse) after each poll, (worker_id, None) when the
        # worker is removed (the frontend's worker counters).
        self.stats_listeners: list = []

    # -- the Router interface ------------------------------------------------------
    def route(self, request: RouteRequest, exclude: frozenset[str] = frozenset()) -> Route | None:
        decoders = {w.worker_id: w for w in self.pool.ready("decode") if w.worker_id not in exclude}
        prefillers = {w.worker_id: w for w in self.pool.ready("prefill") if w.worker_id not in exclude}
        decision = self.core.route(request.request_id, request.token_ids, list(decoders), list(prefillers))
        if decision is None:
            return None
        prefill = prefillers[decision.prefill.winner.worker_id] if decision.prefill else None
        return Route(decoders[decision.decode.winner.worker_id], prefill, _Explanation(decision))

    def on_first_token(self, request_id: str) -> None:
        self.core.on_first_token(request_id)

    def on_finished(self, request_id: str) -> None:
        self.core.on_finished(request_id)

    # -- background work -----------------------------------------------------------
    def _spawn(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.append(task)
        task.add_done_callback(lambda t: t in self._tasks and self._tasks.remove(t))

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._maintain(), name="router maintain"))
        self._tasks.append(asyncio.create_task(self._poll_stats(), name="router stats"))

    async def close(self) -> None:
        tasks = [*self._tasks, *self._sub_tasks.values(), *self._watch_tasks.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._sub_tasks.clear()
        self._watch_tasks.clear()

    async def _maintain(self) -> None:
        while True:
            if self.registry is not None:
                self.registry.changed.clear()
                await self._reconcile(self.registry.members())
            self._start_subscribers()
            waiters = [self.pool.changed.wait()]
            if self.registry is not None:
                waiters.append(self.registry.changed.wait())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(_first(waiters), RECONCILE_INTERVAL_S)
            self.pool.changed.clear()

    async def _reconcile(self, members: dict[str, WorkerRecord]) -> None:
        wanted = {r.address: r for r in members.values()}
        for w in list(self.pool.workers):
            if w.address not in wanted:
                await self._remove(w)
        known = {w.address for w in self.pool.workers}
        for address, r in wanted.items():
            if address not in known:
                handle = WorkerHandle.connect(r.worker_id, r.role, address, self.pool.tls)
                self.pool.workers.append(handle)
                task = asyncio.create_task(self.pool._watch(handle), name=f"watch {address}")
                self._watch_tasks[address] = task
                log.info("router: worker %s (%s) at %s added", r.worker_id, r.role, address)

    async def _remove(self, w: WorkerHandle) -> None:
        log.info("router: worker %s at %s removed (lease lost)", w.worker_id, w.address)
        self.pool.workers.remove(w)
        for tasks in (self._watch_tasks, self._sub_tasks):
            task = tasks.pop(w.address, None)
            if task is not None:
                task.cancel()
        self.subscribers.pop(w.address, None)
        self.core.forget(w.worker_id)
        for listener in self.stats_listeners:
            listener(w.worker_id, None)         # forget its figures
        if self.core.metrics is not None:
            with contextlib.suppress(KeyError):
                self.core.metrics.index_blocks.remove(w.worker_id)
        # Closed in the background: awaiting a close that cancels calls to a hung peer
        # must not stall the reconciler (the worker may re-register a moment later).
        self._spawn(_bounded(w.close(), STATS_TIMEOUT_S), f"close {w.address}")

    def _start_subscribers(self) -> None:
        for w in self.pool.workers:
            if w.info is None or w.address in self._sub_tasks:
                continue
            self.core.set_spec(w.worker_id, WorkerSpec(w.info.block_size or 16, w.info.block_hash_extra_key))
            if not self.subscribe:
                continue
            sub = EventSubscriber(w.worker_id, self.core.index)
            self.subscribers[w.address] = sub
            self._sub_tasks[w.address] = asyncio.create_task(sub.run(w.stub), name=f"kv events {w.address}")

    async def _poll_stats(self) -> None:
        while True:
            try:
                self.core.expire_predictions()   # lapsed ones, also while no request arrives
            except Exception:  # noqa: BLE001 - a bug here must not stop the stats and index-size loop
                log.exception("router: expiring predictions failed")
            workers = list(self.pool.ready())
            calls = {asyncio.ensure_future(w.stub.Stats(worker_pb2.StatsRequest(), timeout=STATS_TIMEOUT_S)): w
                     for w in workers}
            # asyncio.wait, not wait_for: a call whose cancellation hangs (its channel closed by
            # _remove() meanwhile) is left behind instead of stalling this loop.
            done, late = await asyncio.wait(calls, timeout=STATS_TIMEOUT_S + 1) if calls else (set(), set())
            for call in late:
                call.cancel()
                log.warning("router: stats of %s timed out", calls[call].worker_id)
            for call in done:
                w = calls[call]
                if call.cancelled():
                    # Its channel was closed under it (the worker was removed meanwhile).
                    # call.exception() would raise CancelledError here and end this loop.
                    log.info("router: stats of %s cancelled (worker removed)", w.worker_id)
                    continue
                if call.exception() is not None:
                    # e.g. a worker removed (closed channel) or re-added (not yet known) meanwhile
                    log.warning("router: stats of %s failed: %r", w.worker_id, call.exception())
                    continue
                if w not in self.pool.workers:
                    continue
                try:
                    s = call.result()
                    self.core.load.correct(w.worker_id, s.num_used_kv_blocks, s.num_in_flight)
                    for listener in self.stats_listeners:
                        listener(w.worker_id, s)
                except Exception:  # noqa: BLE001 - this loop must outlive any one worker
                    log.exception("router: applying the stats of %s failed", w.worker_id)
            if self.core.metrics is not None:
                for w in self.pool.workers:
                    try:
                        blocks = self.core.index.num_blocks(w.worker_id)
                    except Exception as exc:  # noqa: BLE001
                        log.warning("router: index size of %s unknown: %r", w.worker_id, exc)
                        blocks = 0
                    self.core.metrics.index_blocks.labels(w.worker_id).set(blocks)
            await asyncio.sleep(STATS_INTERVAL_S)


async def _bounded(awaitable, timeout_s: float) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(awaitable, timeout_s)


async def _first(awaitables) -> None:
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def build_router(pool: WorkerPool, policy: str = "kv", prefill_policy: str | None = None, seed: int | None = None,
                 prefill_weight: float = DEFAULT_PREFILL_WEIGHT, temperature: float = 0.0,
                 remote_prefill_threshold: int = 64, registry=None, metrics_registry=None) -> PolicyRouter:
    """A PolicyRouter for the CLI names (kv, round-robin, random, least-loaded, power-of-two).

    KV events are subscribed to, and routed prompts predicted in the index, only when a leg
    uses `kv` (the other policies never read the index).
    """
    from splitserve.router.metrics import RouterMetrics
    from splitserve.router.policies import make_policy

    prefill_policy = prefill_policy or policy
    uses_index = "kv" in (policy, prefill_policy)
    core = RouterCore(make_policy(policy, seed, prefill_weight, temperature),
                      make_policy(prefill_policy, None if seed is None else seed + 1, prefill_weight, temperature),
                      remote_prefill_threshold=remote_prefill_threshold,
                      metrics=RouterMetrics(metrics_registry), predict=uses_index)
    return PolicyRouter(pool, core, registry, subscribe=uses_index)


@dataclass(slots=True, frozen=True)
class _Explanation:
    """A decision's reason for the request log, formatted only if the line is written."""

    decision: RouteDecision

    def __str__(self) -> str:
        return f"{self.decision.decode.explain()}; {self.decision.reason}"
