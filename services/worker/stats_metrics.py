"""A worker's `splitserve_worker_*{worker, role}` Prometheus families, from a Stats snapshot.

They are read at scrape time from the same `StatsResponse` the Stats RPC returns, so the
two never disagree and nothing is kept in step on the engine thread's hot path. While the
engine loads (or once it has stopped) there are no Stats: the scrape still answers 200,
without these families (splitserve/metrics_http.py serves them).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from splitserve.proto.v1 import worker_pb2

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


def stats_reader(read_stats: ReadStats) -> Callable[[], Awaitable[list[Metric]]]:
    """The families to add to each scrape (splitserve/metrics_http.py's `read_families`)."""
    async def read() -> list[Metric]:
        stats = await read_stats()
        return stats_families(stats) if stats is not None else []
    return read
