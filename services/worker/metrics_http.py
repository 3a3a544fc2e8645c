"""`splitserve worker --metrics-port`: Prometheus metrics over plain HTTP (DESIGN section 8).

`GET /metrics` answers with the process's default registry (the kvtransfer
collectors, kvtransfer/metrics.py, and prometheus-client's process metrics) followed
by the worker's own gauges and counters, `splitserve_worker_*{worker, role}`. Those
are read at scrape time from the same `StatsResponse` the Stats RPC returns, so the
two never disagree and nothing is kept in step on the engine thread's hot path. While
the engine loads (or once it has stopped) there are no Stats: the scrape still answers
200, without the `splitserve_worker_*` families. Every other path is 404.

The app is a bare ASGI callable served by uvicorn inside the worker's own event
loop; the socket is bound here first, so a port that is taken is a `SplitserveError`
naming it (uvicorn would log and `sys.exit`), and uvicorn never installs signal
handlers (the worker owns SIGTERM: a drain keeps the metrics up until the end).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator

import uvicorn
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from splitserve.errors import SplitserveError
from splitserve.proto.v1 import worker_pb2

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"     # what generate_latest writes; as the frontend
LABELS = ["worker", "role"]

# (metric name, StatsResponse field, help); every family is labelled `worker`, `role`.
GAUGES = (
    ("splitserve_worker_kv_usage", "kv_usage", "Fraction of the KV blocks in use by requests (0..1)"),
    ("splitserve_worker_kv_blocks", "num_kv_blocks", "KV blocks in the pool"),
    ("splitserve_worker_kv_blocks_used", "num_used_kv_blocks", "KV blocks in use by requests"),
    ("splitserve_worker_kv_blocks_cached", "num_cached_kv_blocks", "KV blocks holding reusable prefixes"),
    ("splitserve_worker_requests_running", "num_running", "Requests the engine is stepping"),
    ("splitserve_worker_requests_waiting", "num_waiting", "Requests waiting for the engine to admit them"),
    ("splitserve_worker_requests_remote_prefill", "num_remote_prefill",
     "Requests waiting for their prompt's KV from a prefill worker"),
    ("splitserve_worker_kv_blocks_remote_prefill", "num_remote_prefill_kv_blocks",
     "KV blocks reserved for prompts a prefill worker has not filled yet (of kv_blocks_used)"),
    ("splitserve_worker_calls_in_flight", "num_in_flight", "Generate and Prefill calls being served"),
    ("splitserve_worker_draining", "draining", "1 once the worker refuses new work (drain)"),
    ("splitserve_worker_kv_blocks_fenced", "num_fenced_kv_blocks",
     "KV blocks of given-up remote prefills kept until their prefill worker stopped writing"),
)
COUNTERS = (    # names without `_total`: the exposition appends it
    ("splitserve_worker_prompt_tokens_computed", "num_prompt_tokens_computed",
     "Prompt tokens the engine computed (prefix hits excluded)"),
    ("splitserve_worker_prefix_hit_tokens", "num_prefix_hit_tokens",
     "Prompt tokens served from the prefix cache"),
    ("splitserve_worker_generated_tokens", "num_generated_tokens", "Tokens generated"),
    ("splitserve_worker_preemptions", "num_preemptions", "Running requests preempted for want of KV blocks"),
    ("splitserve_worker_engine_steps", "num_steps", "Engine steps"),
    ("splitserve_worker_requests_finished", "num_finished", "Requests the engine finished"),
    ("splitserve_worker_requests_aborted", "num_aborted", "Requests the engine aborted"),
    ("splitserve_worker_prefills_served", "num_prefills_served",
     "Prefill calls served for decode workers (prefill role)"),
    ("splitserve_worker_remote_prefills", "num_remote_prefills",
     "Prompts prefilled by a prefill worker (decode role)"),
    ("splitserve_worker_local_prefills", "num_local_prefills", "Prompts this worker prefilled itself"),
    ("splitserve_worker_fences_confirmed", "num_fences_confirmed",
     "Given-up remote prefills whose prefill workers confirmed they stopped writing (decode role)"),
    ("splitserve_worker_fences_waited_out", "num_fences_waited_out",
     "Given-up remote prefills whose blocks waited for the grant's end, unconfirmed (decode role)"),
    ("splitserve_worker_fences_served", "num_fences_served", "FenceTransfer calls answered (prefill role)"),
    ("splitserve_worker_forks", "num_forks",
     "Samples of a prompt (n > 1) that took its KV blocks from a sibling instead of prefilling it"),
    ("splitserve_worker_forked_kv_blocks", "num_forked_kv_blocks",
     "Full KV blocks shared by reference with those forked samples"),
    ("splitserve_worker_fork_copies", "num_fork_copies",
     "Partial last KV blocks copied for forked samples (copy-on-write)"),
)

# Per KV tier (labels worker, role, tier), from StatsResponse.kv_tiers.
TIER_GAUGES = (
    ("splitserve_worker_kv_tier_blocks", "num_blocks", "KV blocks a tier below the pool holds"),
    ("splitserve_worker_kv_tier_capacity_blocks", "capacity_blocks", "KV blocks a tier below the pool can hold"),
)
TIER_COUNTERS = (
    ("splitserve_worker_kv_tier_hits", "num_hits", "KV blocks loaded back into the pool from a tier"),
    ("splitserve_worker_kv_tier_loaded_bytes", "bytes_loaded", "Bytes loaded back into the pool from a tier"),
    ("splitserve_worker_kv_tier_load_seconds", "load_seconds",
     "Seconds spent loading blocks back from a tier (read, verify, copy)"),
    ("splitserve_worker_kv_tier_written_blocks", "num_written", "KV blocks written down into a tier"),
    ("splitserve_worker_kv_tier_evicted_blocks", "num_evicted", "KV blocks a tier evicted for room"),
)

TIER_DROPPED = "splitserve_worker_kv_tier_dropped_blocks"    # labels worker, role, reason

_ROLE_NAMES = {worker_pb2.WORKER_ROLE_PREFILL: "prefill", worker_pb2.WORKER_ROLE_DECODE: "decode",
               worker_pb2.WORKER_ROLE_BOTH: "both"}

ReadStats = Callable[[], Awaitable[worker_pb2.StatsResponse | None]]


def stats_families(stats: worker_pb2.StatsResponse) -> list[Metric]:
    """The `splitserve_worker_*` families of one Stats snapshot."""
    labels = [stats.worker_id, _ROLE_NAMES.get(stats.role, "unspecified")]
    families: list[Metric] = []
    for name, field, doc in GAUGES:
        gauge = GaugeMetricFamily(name, doc, labels=LABELS)
        gauge.add_metric(labels, float(getattr(stats, field)))
        families.append(gauge)
    for name, field, doc in COUNTERS:
        counter = CounterMetricFamily(name, doc, labels=LABELS)
        counter.add_metric(labels, float(getattr(stats, field)))
        families.append(counter)
    if stats.kv_tiers:
        for kind, specs in ((GaugeMetricFamily, TIER_GAUGES), (CounterMetricFamily, TIER_COUNTERS)):
            for name, field, doc in specs:
                family = kind(name, doc, labels=[*LABELS, "tier"])
                for tier in stats.kv_tiers:
                    family.add_metric([*labels, tier.tier], float(getattr(tier, field)))
                families.append(family)
        dropped = CounterMetricFamily(TIER_DROPPED,
                                      "KV blocks dropped instead of used, by reason (recomputed instead)",
                                      labels=[*LABELS, "reason"])
        for reason, count in sorted(stats.kv_tier_rejections.items()):
            dropped.add_metric([*labels, reason], float(count))
        families.append(dropped)
    return families


class _Snapshot(Collector):
    """Families computed before the exposition (generate_latest takes anything with collect())."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


class MetricsApp:
    """ASGI: `GET /metrics` → `registry`, then the worker families of `read_stats()` (None: none)."""

    def __init__(self, read_stats: ReadStats, registry: Collector = REGISTRY) -> None:
        self.read_stats = read_stats
        self.registry = registry

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return          # lifespan is off; websockets are not served
        if scope["path"] != METRICS_PATH:
            await _respond(send, 404, b"not found: try /metrics\n")
        elif scope["method"] not in ("GET", "HEAD"):
            await _respond(send, 405, b"method not allowed\n", extra=((b"allow", b"GET, HEAD"),))
        else:
            await _respond(send, 200, await self.exposition(), CONTENT_TYPE, head=scope["method"] == "HEAD")

    async def exposition(self) -> bytes:
        stats = await self.read_stats()
        body = generate_latest(self.registry)
        if stats is not None:
            body += generate_latest(_Snapshot(stats_families(stats)))
        return body


async def _respond(send, status: int, body: bytes, content_type: bytes = b"text/plain; charset=utf-8",
                   head: bool = False, extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if head else body})


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield       # the worker owns SIGTERM/SIGINT (server.py); uvicorn must not take them


class MetricsServer:
    """The HTTP server; `start` binds and serves in the running loop, `close` stops it."""

    def __init__(self, uv: uvicorn.Server, task: asyncio.Task, port: int) -> None:
        self._uv, self._task, self.port = uv, task, port

    @classmethod
    async def start(cls, app: MetricsApp, host: str, port: int) -> MetricsServer:
        """Listen on host:port (0: any free port); SplitserveError when that fails."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            sock = socket.create_server((host, port), family=family)
        except OSError as exc:
            raise SplitserveError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc} "
                                  "(choose another --metrics-port)") from None
        # log_config=None: uvicorn's records go through the worker's own logging setup.
        uv = _Uvicorn(uvicorn.Config(app, log_config=None, log_level="warning", access_log=False,
                                     lifespan="off", timeout_graceful_shutdown=2))
        task = asyncio.create_task(uv.serve(sockets=[sock]), name="metrics-http")
        return cls(uv, task, sock.getsockname()[1])

    async def close(self) -> None:
        self._uv.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
