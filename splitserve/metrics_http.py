"""Prometheus metrics over plain HTTP for a process that runs no web framework (workers, the KV store).

`GET /metrics` answers with a collector (the process's default registry: the kvtransfer
collectors, kvtransfer/metrics.py, and prometheus-client's process metrics) followed by
families read at scrape time (a worker's `splitserve_worker_*` and `vllm:*` gauges,
services/worker/stats_metrics.py). A family read at scrape time replaces the registry's family
of the same name (an in-process vLLM engine registers its own `vllm:` gauges there): a name
twice in one exposition would make Prometheus' text parsers refuse the whole scrape.
Every other path is 404.

The app is a bare ASGI callable served by uvicorn inside the process's own event
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
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from splitserve.errors import SplitserveError

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"     # what generate_latest writes; as the frontend
class _Snapshot(Collector):
    """Families computed before the exposition (generate_latest takes anything with collect())."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


class _Without(Collector):
    """`collector`'s families but those named in `names`."""

    def __init__(self, collector: Collector, names: set[str]) -> None:
        self._collector, self._names = collector, names

    def collect(self) -> Iterator[Metric]:
        return (family for family in self._collector.collect() if family.name not in self._names)


# The families a scrape adds after the registry's, read at scrape time (a worker's Stats).
ReadFamilies = Callable[[], Awaitable[list[Metric]]]


class MetricsApp:
    """ASGI: `GET /metrics` → `registry`, then the families `read_families()` returns, each in
    place of the registry's family of its name."""

    def __init__(self, read_families: ReadFamilies | None = None, registry: Collector = REGISTRY) -> None:
        self.read_families = read_families
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
        families = await self.read_families() if self.read_families is not None else []
        if not families:
            return generate_latest(self.registry)
        return (generate_latest(_Without(self.registry, {f.name for f in families}))
                + generate_latest(_Snapshot(families)))


async def _respond(send, status: int, body: bytes, content_type: bytes = b"text/plain; charset=utf-8",
                   head: bool = False, extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if head else body})


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield       # the process owns SIGTERM/SIGINT (a worker drains first); uvicorn must not take them


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
