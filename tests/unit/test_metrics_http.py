"""metrics_http's exposition: a family read at scrape time takes the place of the registry's family
of the same name, as when an in-process vLLM engine has registered its own `vllm:` gauges in the
default registry and the worker exports the same names from its Stats."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from splitserve.metrics_http import MetricsApp


def vllm_style_registry() -> CollectorRegistry:
    """What vLLM's PrometheusStatLogger registers, in miniature: a gauge whose name the scrape
    families also give, with a stale value, and a histogram they do not."""
    registry = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    labelnames=["model_name", "engine"], registry=registry)
    running.labels(model_name="m", engine="0").set(7)
    ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                     labelnames=["model_name", "engine"], registry=registry)
    ttft.labels(model_name="m", engine="0").observe(0.2)
    return registry


def exposition(registry: CollectorRegistry, families: list) -> str:
    async def read_families():
        return families

    return asyncio.run(MetricsApp(read_families, registry).exposition()).decode()


def fresh_running(value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                               labels=["model_name", "engine"])
    family.add_metric(["m", "0"], value)
    return family


def test_a_scrape_family_replaces_the_registrys_family_of_its_name():
    text = exposition(vllm_style_registry(), [fresh_running(2)])
    # One HELP and one TYPE per name: a second one makes Prometheus' text parsers refuse the scrape.
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1
    assert text.count("# HELP vllm:num_requests_running ") == 1
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:num_requests_running"]
    assert [(s.labels, s.value) for s in samples] == [({"model_name": "m", "engine": "0"}, 2.0)]
    # The registry's other families stay.
    assert "vllm:time_to_first_token_seconds_count" in text


def test_without_scrape_families_the_registry_is_served_whole():
    text = exposition(vllm_style_registry(), [])
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["vllm:num_requests_running"] == 7
    assert samples["vllm:time_to_first_token_seconds_count"] == 1
