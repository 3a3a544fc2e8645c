"""Prometheus metrics for KV transfers, labelled by backend.

The collectors are created once per registry (prometheus-client refuses to
register the same name twice), so any number of connectors in one process share
them; tests pass their own `CollectorRegistry` and read values back with
`registry.get_sample_value(...)`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

_LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0)


@dataclass(slots=True)
class TransferMetrics:
    """Collectors shared by every connector registered against one registry."""

    bytes: Counter           # labels: backend, direction ("send" | "recv")
    transfers: Counter       # labels: backend, direction, kind ("write" | "notify")
    latency: Histogram       # labels: backend; post → completion of one write, seconds
    failures: Counter        # labels: backend, reason (TransferError.reason)


_lock = threading.Lock()
_by_registry: dict[int, TransferMetrics] = {}


def transfer_metrics(registry: CollectorRegistry | None = None) -> TransferMetrics:
    """The metrics on `registry` (the process default when None), created on first use."""
    registry = REGISTRY if registry is None else registry
    with _lock:
        metrics = _by_registry.get(id(registry))
        if metrics is None:
            metrics = TransferMetrics(
                bytes=Counter("splitserve_kv_transfer_bytes", "KV bytes moved", ["backend", "direction"],
                              registry=registry),
                transfers=Counter("splitserve_kv_transfers", "KV transfers completed",
                                  ["backend", "direction", "kind"], registry=registry),
                latency=Histogram("splitserve_kv_transfer_seconds", "KV write latency, post to completion",
                                  ["backend"], buckets=_LATENCY_BUCKETS, registry=registry),
                failures=Counter("splitserve_kv_transfer_failures", "KV transfers refused or failed",
                                 ["backend", "reason"], registry=registry),
            )
            _by_registry[id(registry)] = metrics
        return metrics
