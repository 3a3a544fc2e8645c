"""What keeps a `RouterCore`'s view of the workers current: KV events and Stats, in the background.

`RouterFeeds` listens to the worker pool's membership (a `MembershipListener`,
workers/pool.py) and never changes it: the pool alone adds and removes
workers, and the feeds follow.

- A worker that has described itself gets its block spec recorded (its block
  size and block-hash extra key come from Describe) and, when a leg routes by
  `kv`, one KvEvents subscriber (router/subscriber.py), so a frontend that
  starts or restarts builds its index from the workers alone.
- A removed worker's subscriber is cancelled and the core forgets it (index,
  load, spec), as do the stats listeners and the index-size gauge.
- A Stats poller corrects the load model from the ready workers' own figures
  every `stats_interval_s`, drops lapsed routing predictions from the index,
  and exports each worker's index size. Its failures repeat on every pass while a
  worker is busy (a long prefill outlasting the Stats deadline) or going: each is
  logged as one line, at most once per worker and kind every 30 s, with a count of
  the repeats held back (splitserve/logs.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from splitserve.logs import DEFAULT_INTERVAL_S, RateLimitedLog, one_line_error
from splitserve.proto.v1 import worker_pb2
from splitserve.router.core import RouterCore, WorkerSpec
from splitserve.router.index import LOWER_TIERS
from splitserve.router.subscriber import EventSubscriber

from splitserve.services.frontend.workers.pool import WorkerHandle, WorkerPool

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.5
STATS_TIMEOUT_S = 2.0

# Called with (worker_id, StatsResponse) after each poll, (worker_id, None) when the worker
# is removed (the frontend's worker counters, fault_metrics.py).
StatsListener = Callable[[str, worker_pb2.StatsResponse | None], None]


class RouterFeeds:
    def __init__(self, pool: WorkerPool, core: RouterCore, subscribe: bool = True,
                 stats_interval_s: float = STATS_INTERVAL_S, stats_timeout_s: float = STATS_TIMEOUT_S,
                 warning_interval_s: float = DEFAULT_INTERVAL_S, clock: Callable[[], float] = time.monotonic):
        self.pool = pool
        self.core = core
        self.subscribe = subscribe          # KV events only when a leg reads the index
        self.stats_interval_s = stats_interval_s
        self.stats_timeout_s = stats_timeout_s
        self.subscribers: dict[str, EventSubscriber] = {}     # by worker address
        self._sub_tasks: dict[str, asyncio.Task] = {}
        self._poller: asyncio.Task | None = None
        self.stats_listeners: list[StatsListener] = []
        # keyed (worker id, what failed): one line per worker and kind per interval
        self.warnings = RateLimitedLog(log, warning_interval_s, clock)

    def start(self) -> None:
        self.pool.subscribe(self)           # replays the workers already there
        self._poller = asyncio.create_task(self._poll_forever(), name="router stats")

    async def close(self) -> None:
        self.pool.unsubscribe(self)
        tasks = [*self._sub_tasks.values(), *([self._poller] if self._poller else [])]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._sub_tasks.clear()
        self._poller = None

    # -- membership (the pool tells) -------------------------------------------------
    def worker_added(self, worker: WorkerHandle) -> None:
        """Nothing to do until it describes itself (its block spec, its worker id)."""

    def worker_described(self, worker: WorkerHandle) -> None:
        self.core.set_spec(worker.worker_id, WorkerSpec(worker.info.block_size or 16,
                                                        worker.info.block_hash_extra_key))
        if not self.subscribe or worker.address in self._sub_tasks:
            return              # a restarted worker: its subscriber resyncs by itself
        sub = EventSubscriber(worker.worker_id, self.core.index)
        self.subscribers[worker.address] = sub
        self._sub_tasks[worker.address] = asyncio.create_task(sub.run(worker.stub),
                                                              name=f"kv events {worker.address}")

    def worker_removed(self, worker: WorkerHandle) -> None:
        task = self._sub_tasks.pop(worker.address, None)
        if task is not None:
            task.cancel()
        self.subscribers.pop(worker.address, None)
        self.core.forget(worker.worker_id)
        self.warnings.forget(lambda key: key[0] == worker.worker_id)
        for listener in self.stats_listeners:
            listener(worker.worker_id, None)         # forget its figures
        if self.core.metrics is not None:
            with contextlib.suppress(KeyError):
                self.core.metrics.index_blocks.remove(worker.worker_id)
            for tier in LOWER_TIERS:
                with contextlib.suppress(KeyError):
                    self.core.metrics.index_tier_blocks.remove(worker.worker_id, tier)

    # -- the stats poller ----------------------------------------------------------
    async def _poll_forever(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.stats_interval_s)

    async def poll_once(self) -> None:
        """Expire predictions, apply every ready worker's Stats, export the index sizes."""
        try:
            self.core.expire_predictions()   # lapsed ones, also while no request arrives
        except Exception:  # noqa: BLE001 - a bug here must not stop the stats and index-size loop
            log.exception("router: expiring predictions failed")
        calls = {asyncio.ensure_future(w.stub.Stats(worker_pb2.StatsRequest(), timeout=self.stats_timeout_s)): w
                 for w in self.pool.ready()}
        # asyncio.wait, not wait_for: a call whose cancellation hangs (its channel closed by
        # the pool's removal meanwhile) is left behind instead of stalling this loop.
        done, late = await asyncio.wait(calls, timeout=self.stats_timeout_s + 1) if calls else (set(), set())
        for call in late:
            call.cancel()
            worker_id = calls[call].worker_id
            self.warnings.warning((worker_id, "stats"), "router: stats of %s timed out", worker_id)
        for call in done:
            self._apply_stats(calls[call], call)
        if self.core.metrics is not None:
            for w in self.pool.workers:
                try:
                    blocks = self.core.index.num_blocks(w.worker_id)
                except Exception as exc:  # noqa: BLE001
                    self.warnings.warning((w.worker_id, "index size"), "router: index size of %s unknown: %s",
                                          w.worker_id, one_line_error(exc))
                    blocks = 0
                self.core.metrics.index_blocks.labels(w.worker_id).set(blocks)
                if self.core.index.has_lower_tiers():
                    for tier in LOWER_TIERS:
                        self.core.metrics.index_tier_blocks.labels(w.worker_id, tier).set(
                            self.core.index.num_tier_blocks(w.worker_id, tier))

    def _apply_stats(self, w: WorkerHandle, call: asyncio.Future) -> None:
        if call.cancelled():
            # Its channel was closed under it (the worker was removed meanwhile).
            # call.exception() would raise CancelledError here and end the poller.
            log.info("router: stats of %s cancelled (worker removed)", w.worker_id)
            return
        if call.exception() is not None:
            # e.g. a worker removed (closed channel) or re-added (not yet known) meanwhile
            # one line (the status code and details, not the error's multi-line repr)
            self.warnings.warning((w.worker_id, "stats"), "router: stats of %s failed: %s", w.worker_id,
                                  one_line_error(call.exception()))
            return
        if not self.pool.holds(w):
            return
        try:
            s = call.result()
            self.core.load.correct(w.worker_id, s.num_used_kv_blocks, s.num_in_flight)
            for listener in self.stats_listeners:
                listener(w.worker_id, s)
        except Exception:  # noqa: BLE001 - the poller must outlive any one worker
            log.exception("router: applying the stats of %s failed", w.worker_id)
