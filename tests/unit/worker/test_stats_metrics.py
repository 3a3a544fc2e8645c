"""A worker's scrape families from one Stats snapshot: vLLM's gauges, as an endpoint picker reads them.

llm-d's metrics extractor (and the Gateway API Inference Extension's model-server protocol)
reads `vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc` and the
`block_size` / `num_gpu_blocks` labels of `vllm:cache_config_info`; everything here is read back
from the exposition text a scrape gets (metrics_http's MetricsApp over an empty registry).
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from splitserve.metrics_http import MetricsApp
from splitserve.proto.v1 import worker_pb2
from splitserve.services.worker.stats_metrics import (VLLM_CACHE_CONFIG, VLLM_KV_USAGE, VLLM_RUNNING, VLLM_WAITING,
                                                      ServedModel, stats_reader)

STATS = worker_pb2.StatsResponse(worker_id="d0", role=worker_pb2.WORKER_ROLE_DECODE, num_kv_blocks=800,
                                 num_used_kv_blocks=200, kv_usage=0.25, num_running=5, num_waiting=3,
                                 num_remote_prefill=2)
MODEL = ServedModel(model_name="qwen3-8b", block_size=16)


def scrape(stats: worker_pb2.StatsResponse | None, model: ServedModel | None) -> dict:
    async def read_stats():
        return stats

    app = MetricsApp(stats_reader(read_stats, lambda: model), registry=CollectorRegistry())
    text = asyncio.run(app.exposition()).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def only_sample(family):
    [sample] = family.samples
    return sample


def test_the_scheduler_and_kv_gauges_carry_vllms_names_and_labels():
    families = scrape(STATS, MODEL)
    for name in (VLLM_WAITING, VLLM_RUNNING, VLLM_KV_USAGE):
        assert families[name].type == "gauge", name
        assert only_sample(families[name]).labels == {"model_name": "qwen3-8b", "engine": "0"}, name
    # vLLM counts a request waiting for its prompt's KV from a prefill worker as waiting.
    assert only_sample(families[VLLM_WAITING]).value == 3 + 2
    assert only_sample(families[VLLM_RUNNING]).value == 5
    assert only_sample(families[VLLM_KV_USAGE]).value == 0.25          # a fraction, as vLLM's


def test_cache_config_info_is_an_info_gauge_with_the_block_size_and_count():
    info = only_sample(scrape(STATS, MODEL)[VLLM_CACHE_CONFIG])
    assert info.value == 1
    assert info.labels == {"model_name": "qwen3-8b", "engine": "0", "block_size": "16", "num_gpu_blocks": "800"}
    # llm-d parses both labels as integers (strconv.Atoi).
    assert int(info.labels["block_size"]) * int(info.labels["num_gpu_blocks"]) == 12800


def test_the_worker_families_stay_beside_them():
    families = scrape(STATS, MODEL)
    assert only_sample(families["splitserve_worker_requests_waiting"]).value == 3
    assert only_sample(families["splitserve_worker_kv_usage"]).labels == {"worker": "d0", "role": "decode"}


def test_without_the_model_or_without_stats_no_vllm_family_is_made_up():
    before_describe = scrape(STATS, None)
    assert "splitserve_worker_kv_usage" in before_describe
    assert not [name for name in before_describe if name.startswith("vllm:")]
    loading = scrape(None, MODEL)
    assert not [name for name in loading if name.startswith(("vllm:", "splitserve_worker_"))]
