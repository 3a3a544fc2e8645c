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
    transfers: Counter       # labels: backend, direction, kind ("write" | "notify" | "progress")
    latency: Histogram       # labels: backend; post → completion of one write, seconds
    failures: Counter        # labels: backend, reason (TransferError.reason)
    # Per send, from the sender's own timestamps (rank_transfer.py), labels: backend.
    layer_lead: Histogram    # prompt's last layer posted - first layer's writes complete (0: none ahead)
    exposed: Histogram       # prompt's last layer posted -> completion notification delivered
    layer_compute: Histogram  # the prompt's compute per layer, as the sender's layer reports came
    digest_mismatches: Counter  # receiver: transfers refused because the blocks differ from what was sent


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
                layer_lead=Histogram("splitserve_kv_transfer_layer_lead_seconds",
                                     "How long before the prompt's last layer was computed its first layer's KV "
                                     "had landed at the receiver (0: not before)", ["backend"],
                                     buckets=(0.0, *_LATENCY_BUCKETS), registry=registry),
                exposed=Histogram("splitserve_kv_transfer_exposed_seconds",
                                  "From the prompt's last layer computed to the transfer's completion "
                                  "notification delivered: the transfer time the prefill did not hide",
                                  ["backend"], buckets=_LATENCY_BUCKETS, registry=registry),
                layer_compute=Histogram("splitserve_kv_transfer_layer_compute_seconds",
                                        "A prompt's compute time per layer, from the sender's first to its last "
                                        "layer report", ["backend"], buckets=_LATENCY_BUCKETS, registry=registry),
                digest_mismatches=Counter("splitserve_kv_transfer_digest_mismatches",
                                          "Transfers refused by the receiver: the blocks it holds differ from "
                                          "what the sender wrote (recomputed instead)", ["backend"],
                                          registry=registry),
            )
            _by_registry[id(registry)] = metrics
        return metrics
