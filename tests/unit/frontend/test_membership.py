"""The worker pool owns its membership; the router's feeds follow it.

Registries are real (splitserve/discovery/static.py stepped by the test, and
EtcdRegistry against a real etcd (tests/conftest.py) that is stopped for the
outage); workers are small in-process gRPC servers answering Health,
Describe and Stats. Nothing sleeps: each step awaits the listener event it
causes (with a timeout that only a failure reaches).
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from splitserve.net import free_port
from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc
from splitserve.router.core import WorkerSpec
from splitserve.discovery import WorkerRecord
from splitserve.discovery.etcd import EtcdRegistration, EtcdRegistry
from splitserve.discovery.static import StaticRegistry
from splitserve.services.frontend.router_feeds import RouterFeeds
from splitserve.services.frontend.routing import PoolRouter, RouteRequest, build_router
from splitserve.services.frontend.workers.pool import WorkerAddress, WorkerPool
from splitserve.testing.clock import FakeClock

TIMEOUT_S = 10          # reached only when an expected event never comes


class Recorder:
    """A MembershipListener that queues what it is told."""

    def __init__(self) -> None:
        self.events: asyncio.Queue[tuple[str, str]] = asyncio.Queue()

    def worker_added(self, worker) -> None:
        self.events.put_nowait(("added", worker.address))

    def worker_described(self, worker) -> None:
        self.events.put_nowait(("described", worker.address))

    def worker_removed(self, worker) -> None:
        self.events.put_nowait(("removed", worker.address))

    async def next(self) -> tuple[str, str]:
        return await asyncio.wait_for(self.events.get(), TIMEOUT_S)


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """Health (SERVING), Describe and Stats of one worker on 127.0.0.1."""

    def __init__(self, worker_id: str, used_blocks: int) -> None:
        self.worker_id = worker_id
        self.used_blocks = used_blocks
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    async def start(self) -> "FakeWorker":
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        return self

    async def Describe(self, request, context):
        return worker_pb2.DescribeResponse(worker_id=self.worker_id, instance_id="i1", max_model_len=100,
                                           block_size=4, block_hash_extra_key=b"k")

    async def Stats(self, request, context):
        return worker_pb2.StatsResponse(worker_id=self.worker_id, num_used_kv_blocks=self.used_blocks,
                                        num_in_flight=1)


def _records(n: int) -> list[WorkerRecord]:
    """Workers at addresses nobody listens on: their health watches keep retrying."""
    return [WorkerRecord(f"w{i}", "both", f"127.0.0.1:{free_port()}") for i in range(n)]


def test_the_pool_follows_the_registry_and_tells_each_change_once():
    async def go():
        a, b, c = _records(3)
        registry = StaticRegistry([a])
        pool = WorkerPool(registry=registry)
        early = Recorder()
        pool.subscribe(early)
        pool.start()
        assert [w.address for w in pool.workers] == [a.address]
        assert await early.next() == ("added", a.address)
        late = Recorder()
        pool.subscribe(late)                       # replays the members it missed
        assert await late.next() == ("added", a.address)
        registry.add(b)
        assert await early.next() == ("added", b.address)
        pool.reconcile()                           # a pass without a change tells nothing
        assert early.events.empty()
        registry.remove(a.worker_id)
        assert await early.next() == ("removed", a.address)
        registry.add(c)
        assert await early.next() == ("added", c.address)
        assert [w.address for w in pool.workers] == [b.address, c.address]
        assert [await late.next() for _ in range(3)] == [("added", b.address), ("removed", a.address),
                                                        ("added", c.address)]
        assert early.events.empty() and late.events.empty()
        pool.unsubscribe(late)
        registry.remove(b.worker_id)
        assert await early.next() == ("removed", b.address)
        assert late.events.empty()
        await pool.close()

    asyncio.run(go())


def test_a_removed_workers_health_watch_is_cancelled():
    async def go():
        a, b = _records(2)
        registry = StaticRegistry([a, b])
        pool = WorkerPool(registry=registry)
        recorder = Recorder()
        pool.subscribe(recorder)
        pool.start()
        watches = {t.get_name(): t for t in asyncio.all_tasks()}
        watch_a, watch_b = watches[f"watch {a.address}"], watches[f"watch {b.address}"]
        removed = next(w for w in pool.workers if w.address == a.address)
        registry.remove(a.worker_id)
        while await recorder.next() != ("removed", a.address):
            pass
        assert watch_a.cancelling() == 1           # cancelled by the removal itself
        await asyncio.wait([watch_a], timeout=TIMEOUT_S)
        assert watch_a.cancelled() and not watch_b.done()
        assert not pool.holds(removed) and [w.address for w in pool.workers] == [b.address]
        await pool.close()
        assert watch_b.cancelled()

    asyncio.run(go())


def test_a_worker_that_turns_serving_is_described_once():
    async def go():
        worker = await FakeWorker("w7", used_blocks=0).start()
        pool = WorkerPool.connect([WorkerAddress("both", worker.address)])
        recorder = Recorder()
        pool.subscribe(recorder)
        try:
            pool.start()
            assert [await recorder.next() for _ in range(2)] == [("added", worker.address),
                                                                 ("described", worker.address)]
            (handle,) = pool.workers
            assert handle.worker_id == "w7" and handle.ready and handle.info.block_size == 4
            assert pool.ready("decode") == [handle] and pool.all_ready()
            assert recorder.events.empty()
        finally:
            await pool.close()
            await worker.server.stop(0)

    asyncio.run(go())


class _Flag(logging.Handler):
    """Sets an asyncio.Event when a record's message starts with `prefix`."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.event = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith(self.prefix):
            self.event.set()


def test_the_pool_keeps_its_members_while_etcd_is_unreachable(etcd):
    """A real etcd (tests/conftest.py): two workers register, then etcd stops."""
    async def go():
        records = _records(2)
        registrations = [EtcdRegistration([etcd.endpoint], r, ttl_s=30) for r in records]
        unreachable = _Flag("etcd unreachable")
        etcd_log = logging.getLogger("splitserve.discovery.etcd")
        etcd_log.addHandler(unreachable)
        registry = EtcdRegistry([etcd.endpoint])
        try:
            for registration in registrations:
                await registration.start()
            await registry.start()
            pool = WorkerPool(registry=registry)
            recorder = Recorder()
            pool.subscribe(recorder)
            pool.start()
            assert {await recorder.next(), await recorder.next()} == {("added", r.address) for r in records}
            for registration in registrations:
                registration.pause()             # no lease refresh against a stopped etcd
            await asyncio.to_thread(etcd.stop)
            await asyncio.wait_for(unreachable.event.wait(), TIMEOUT_S)
            pool.reconcile()                     # what the pool's next pass sees while etcd is away
            assert sorted(w.address for w in pool.workers) == sorted(r.address for r in records)
            assert recorder.events.empty() and not registry.connected
            await pool.close()
        finally:
            etcd_log.removeHandler(unreachable)
            await registry.close()
            for registration in registrations:
                await registration.close(revoke=False)

    asyncio.run(go())


def test_the_router_feeds_follow_membership_and_apply_stats():
    async def go():
        workers = [FakeWorker("w0", used_blocks=7), FakeWorker("w1", used_blocks=3)]
        registry = StaticRegistry([WorkerRecord(w.worker_id, "both", w.address) for w in workers])
        pool = WorkerPool(registry=registry)
        metrics = CollectorRegistry()
        built = build_router(pool, "round-robin", metrics_registry=metrics)
        router = PoolRouter(pool, built.core, RouterFeeds(pool, built.core, subscribe=False, stats_interval_s=0.01))
        stats: asyncio.Queue = asyncio.Queue()
        router.feeds.stats_listeners.append(lambda wid, s: stats.put_nowait((wid, s and s.num_used_kv_blocks)))
        try:
            for w in workers:
                await w.start()
            pool.start()
            router.start()
            seen = set()
            while seen != {("w0", 7), ("w1", 3)}:
                seen.add(await asyncio.wait_for(stats.get(), TIMEOUT_S))
            core = router.core
            assert core.specs == {"w0": WorkerSpec(4, b"k"), "w1": WorkerSpec(4, b"k")}
            assert (core.load.decode_blocks("w0"), core.load.decode_blocks("w1")) == (7, 3)
            assert metrics.get_sample_value("splitserve_router_index_blocks", {"worker": "w0"}) == 0
            core.index.stored("w0", [b"h0"])
            registry.remove("w0")
            while await asyncio.wait_for(stats.get(), TIMEOUT_S) != ("w0", None):
                pass
            assert "w0" not in core.specs and core.index.num_blocks("w0") == 0
            assert core.load.decode_blocks("w0") == 0
            assert metrics.get_sample_value("splitserve_router_index_blocks", {"worker": "w0"}) is None
            assert router.route(RouteRequest("r", [1, 2, 3])).decode.worker_id == "w1"
        finally:
            await router.close()
            await pool.close()
            for w in workers:
                await w.server.stop(0)

    asyncio.run(go())


class BusyWorker(FakeWorker):
    """A worker deep in a long prefill: its Stats answer comes after the caller's deadline."""

    async def Stats(self, request, context):
        await asyncio.sleep(5)
        return await super().Stats(request, context)


def test_a_stats_call_that_keeps_timing_out_is_one_line_per_30_s(caplog):
    async def go():
        worker = BusyWorker("w0", used_blocks=1)
        pool = WorkerPool(registry=StaticRegistry([WorkerRecord("w0", "both", worker.address)]))
        recorder = Recorder()
        clock = FakeClock()
        built = build_router(pool, "round-robin")
        feeds = RouterFeeds(pool, built.core, subscribe=False, stats_timeout_s=0.05, clock=clock)
        try:
            await worker.start()
            pool.subscribe(recorder)
            pool.start()
            while await recorder.next() != ("described", worker.address):
                pass
            with caplog.at_level(logging.WARNING, logger="splitserve.services.frontend.router_feeds"):
                for i in range(5):                    # five passes of the poller, 0.5 s apart
                    clock.advance(0.5 if i else 0.0)
                    await feeds.poll_once()
                clock.advance(28.0)                   # 30 s after the first line
                await feeds.poll_once()
        finally:
            await pool.close()
            await worker.server.stop(0)
        return [r.getMessage() for r in caplog.records if r.name.endswith("router_feeds")]

    lines = asyncio.run(go())
    assert lines == ["router: stats of w0 failed: DEADLINE_EXCEEDED: Deadline Exceeded",
                     "router: stats of w0 failed: DEADLINE_EXCEEDED: Deadline Exceeded "
                     "(4 more like this in the last 30 s)"], lines
