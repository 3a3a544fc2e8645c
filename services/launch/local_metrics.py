"""`serve --autoscale`'s samples: serve's frontends' /metrics and its serving workers' Stats (the
shared loop's `SampleSource`, services/autoscaling).

Each call reads, at one time, every frontend's /metrics (the Prometheus text it exports:
request counters, prompt and generated tokens, the TTFT and inter-token histograms) and the
Stats of every worker SERVING (gRPC: KV usage, running and waiting requests, token
counters; one that does not answer is left out), and turns the difference from the previous
reading into the planner's `MetricsSample` (planner/readings.py: `SampleBuilder`, whose header
gives the rules). The first reading only sets the baseline. A frontend that does not answer
gives no sample (said once, until it answers again; the next sample then spans the intervals
since the last reading); one that restarted (its counters went down: they are summed with the
others') makes the reading a new baseline.

The calls block (urllib, a synchronous gRPC channel): the loop runs on the autoscaler thread's
own event loop, where nothing else waits (autoscale_thread.py).
"""

from __future__ import annotations

import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import grpc

from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc
from splitserve.services.planner import MetricsSample, ReplicaCounts
from splitserve.services.planner.readings import FrontendCounters, Reading, SampleBuilder, WorkerCounters
from splitserve.tls import PLAINTEXT, TlsConfig

SCRAPE_TIMEOUT_S = 2.0


class LocalMetricsSource:
    def __init__(self, frontend_urls: list[str], serving: Callable[[], list[tuple[str, str]]],
                 say: Callable[[str], None], tls: TlsConfig = PLAINTEXT):
        self.frontend_urls = frontend_urls           # each frontend's base URL (http[s]://host:port)
        self.serving = serving                       # (role, address) of each worker SERVING
        self.say = say
        self.tls = tls
        self.builder = SampleBuilder()
        self.last_reading: Reading | None = None
        self._frontends: list[FrontendCounters] = []          # each frontend's last reading
        self._scrape_failing = False

    async def sample(self, replicas: ReplicaCounts) -> MetricsSample | None:
        reading = self.read()
        if reading is None:
            return None
        self.last_reading = reading
        return self.builder.sample(reading, replicas)

    def read(self) -> Reading | None:
        """The frontends' metrics and the serving workers' Stats now; None when a frontend did not
        answer (the interval then runs on to the next reading)."""
        timestamp = time.monotonic()
        try:
            each = [FrontendCounters.parse(_get(f"{url}/metrics")) for url in self.frontend_urls]
        except (urllib.error.URLError, OSError, ValueError) as exc:
            if not self._scrape_failing:
                self.say(f"autoscale: cannot read a frontend's /metrics ({exc}); waiting for it")
            self._scrape_failing = True
            return None
        self._scrape_failing = False
        if any(now.ended < before.ended or (now.admitted or 0) < (before.admitted or 0)
               for now, before in zip(each, self._frontends)):
            self.builder.previous = None     # a frontend restarted: its counters are summed with the others'
        self._frontends = each
        frontend = FrontendCounters.total(each)
        workers = []
        for role, address in self.serving():
            stats = self._stats(address)
            if stats is not None:
                workers.append(WorkerCounters.of_stats(role, stats))
        return Reading(timestamp, frontend, tuple(workers))

    def _stats(self, address: str) -> worker_pb2.StatsResponse | None:
        with self.tls.channel(address) as channel:
            try:
                return worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=SCRAPE_TIMEOUT_S)
            except grpc.RpcError:
                return None


def _get(url: str) -> str:
    # Our own child: with HTTPS its certificate is not checked here (as probes.http_ready).
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S, context=context) as reply:
        return reply.read().decode()
