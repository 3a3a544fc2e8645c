"""The frontend's fault metrics (DESIGN sections 7 and 8): migrations, cancellations, failures,
and the workers' own prefill retry counters.

- `splitserve_migrations_total{outcome}`: one per broken worker stream. `migrated`: re-dispatched
  after tokens had been forwarded; `retried`: re-dispatched before the first token; `refused_*`:
  not re-dispatched, for the reason named (`disabled`, `limit`, `no_worker`, `context_full`).
- `splitserve_request_moves_total{method}`: running requests moved to another decode worker without
  a fault (an operator's `admin migrate`, a decode worker draining; live_moves.py): `kv` when their
  KV moved, `replay` when the new worker recomputed the context.
- `splitserve_cancellations_total{api, phase}`: the client went away `before_first_token` or
  `streaming`.
- `splitserve_request_failures_total{api, reason}`: requests that ended with a server-side error
  (the reason is a migration refusal, `no_worker`, or the worker's gRPC status in lower case).
- `splitserve_worker_prefill_retries_total{worker}` / `..._prefill_fallbacks_total{worker}`:
  the decode workers' counters (another prefill worker tried / prefilled locally after every
  prefill worker failed), as last read from their Stats by the router's poller.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from splitserve.proto.v1 import worker_pb2

OUTCOME_MIGRATED = "migrated"
OUTCOME_RETRIED = "retried"
PHASE_BEFORE_FIRST_TOKEN = "before_first_token"
PHASE_STREAMING = "streaming"


class WorkerCounters(Collector):
    """Exposes counters the workers keep, from the latest Stats of each worker."""

    def __init__(self) -> None:
        self._latest: dict[str, worker_pb2.StatsResponse] = {}

    def update(self, worker_id: str, stats: worker_pb2.StatsResponse | None) -> None:
        """The worker's latest Stats; None forgets a removed worker."""
        if stats is None:
            self._latest.pop(worker_id, None)
        else:
            self._latest[worker_id] = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        retries = CounterMetricFamily("splitserve_worker_prefill_retries",
                                      "Remote prefills retried on another prefill worker, per decode worker",
                                      labels=["worker"])
        fallbacks = CounterMetricFamily("splitserve_worker_prefill_fallbacks",
                                        "Prompts prefilled locally after every prefill worker failed, "
                                        "per decode worker", labels=["worker"])
        for worker_id, s in sorted(self._latest.items()):
            retries.add_metric([worker_id], s.num_prefill_retries)
            fallbacks.add_metric([worker_id], s.num_prefill_fallbacks)
        yield retries
        yield fallbacks


class WorkerRestarts(Collector):
    """Workers that came back as a new instance at the same address (restarted), per worker."""

    def __init__(self, workers: Callable[[], Iterable]) -> None:
        self._workers = workers

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("splitserve_worker_restarts",
                                     "Times a worker answered as a new instance at its address (it restarted)",
                                     labels=["worker"])
        for w in sorted(self._workers(), key=lambda w: w.worker_id):
            family.add_metric([w.worker_id], w.num_restarts)
        yield family


class FaultMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.migrations = Counter("splitserve_migrations", "Broken worker streams by what the frontend did",
                                  ["outcome"], registry=registry)
        self.moves = Counter("splitserve_request_moves", "Running requests moved to another decode worker "
                             "without a fault, by whether their KV moved", ["method"], registry=registry)
        self.cancellations = Counter("splitserve_cancellations", "Requests the client abandoned",
                                     ["api", "phase"], registry=registry)
        self.failures = Counter("splitserve_request_failures", "Requests that failed on the server side",
                                ["api", "reason"], registry=registry)
        self.workers = WorkerCounters()
        registry.register(self.workers)
        # Set by `splitserve serve`'s supervisor when it restarts this frontend (services/launch/supervisor.py).
        self.process_restarts = Gauge("splitserve_process_restarts",
                                      "Times the supervisor (splitserve serve) restarted this frontend process",
                                      registry=registry)
        self.process_restarts.set(int(os.environ.get("SPLITSERVE_RESTARTS", "0") or 0))
