"""A worker's `splitserve_worker_*{worker, role}` Prometheus families, from a Stats snapshot.

They are read at scrape time from the same `StatsResponse` the Stats RPC returns, so the
two never disagree and nothing is kept in step on the engine thread's hot path. While the
engine loads (or once it has stopped) there are no Stats: the scrape still answers 200,
without these families (splitserve/metrics_http.py serves them).

The same snapshot also gives the gauges a Gateway API Inference Extension endpoint picker
scrapes, under vLLM's names and labels (`vllm:num_requests_waiting`, `..._running`,
`vllm:kv_cache_usage_perc`, `vllm:cache_config_info`; `model_name`, `engine`), so that a stock
llm-d picker can schedule splitserve workers of either engine. A vLLM engine in the worker's
process registers its own `vllm:` collectors in the default registry; metrics_http serves a
scrape family in their place (one series per name), so both engines export the same numbers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

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
    ("splitserve_worker_suspended_requests_held", "num_suspended_held",
     "Suspended requests whose KV waits to be read by a live migration's destination"),
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
    ("splitserve_worker_requests_suspended", "num_suspended",
     "Running requests suspended here for a live migration to another decode worker"),
    ("splitserve_worker_kv_migrations_sent", "num_kv_migrations_sent",
     "Suspended requests whose KV was sent from here to the decode worker taking them over"),
    ("splitserve_worker_kv_migrations_received", "num_kv_migrations_received",
     "Migrated requests that arrived with their KV from another decode worker"),
    ("splitserve_worker_kv_migration_fallbacks", "num_kv_migration_fallbacks",
     "Migrated requests whose KV could not be moved here, so their context was recomputed"),
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

# vLLM's names (vllm/v1/metrics/loggers.py, PrometheusStatLogger), which llm-d's metrics extractor
# reads by default; vLLM's `engine` label is the engine core's index, one engine per worker here.
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"
VLLM_CACHE_CONFIG = "vllm:cache_config_info"
VLLM_LABELS = ["model_name", "engine"]
VLLM_ENGINE_INDEX = "0"


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the `vllm:` families name besides the load: the model clients ask for (Describe's
    `model_name`) and the tokens per KV block."""

    model_name: str
    block_size: int


ReadServedModel = Callable[[], ServedModel | None]


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


def vllm_families(stats: worker_pb2.StatsResponse, model: ServedModel) -> list[Metric]:
    """vLLM's scheduler and cache gauges of one Stats snapshot, as an endpoint picker reads them.

    vLLM counts a request waiting for its prompt's KV from a prefill worker as waiting; Stats
    keeps those apart (`num_remote_prefill`), so they are added back. `num_gpu_blocks` is the
    blocks requests can hold (vLLM's own count also has its null block)."""
    labels = [model.model_name, VLLM_ENGINE_INDEX]
    families: list[Metric] = []
    for name, doc, value in (
            (VLLM_WAITING, "Number of requests waiting to be processed.", stats.num_waiting + stats.num_remote_prefill),
            (VLLM_RUNNING, "Number of requests in model execution batches.", stats.num_running),
            (VLLM_KV_USAGE, "KV-cache usage. 1 means 100 percent usage.", stats.kv_usage)):
        gauge = GaugeMetricFamily(name, doc, labels=VLLM_LABELS)
        gauge.add_metric(labels, float(value))
        families.append(gauge)
    info = GaugeMetricFamily(VLLM_CACHE_CONFIG, "Information of the LLMEngine CacheConfig",
                             labels=[*VLLM_LABELS, "block_size", "num_gpu_blocks"])
    info.add_metric([*labels, str(model.block_size), str(stats.num_kv_blocks)], 1.0)
    families.append(info)
    return families


def stats_reader(read_stats: ReadStats, read_model: ReadServedModel) -> Callable[[], Awaitable[list[Metric]]]:
    """The families to add to each scrape (splitserve/metrics_http.py's `read_families`): the
    `splitserve_worker_*` ones, and vLLM's once the model is known."""
    async def read() -> list[Metric]:
        stats = await read_stats()
        if stats is None:
            return []
        model = read_model()
        return stats_families(stats) + (vllm_families(stats, model) if model is not None else [])
    return read
