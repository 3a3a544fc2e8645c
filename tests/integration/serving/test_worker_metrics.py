"""`splitserve worker --metrics-port`: Prometheus metrics served over HTTP by the workers.

Real `splitserve worker` processes (one prefill, one decode, TCP transfer) and one
disaggregated Generate over the worker gRPC API; everything asserted is read from
the real /metrics text: the per-worker `splitserve_worker_*` families (taken from
the Stats data), vLLM's gauges that an endpoint picker reads (`vllm:*`, from the same
Stats and Describe), the kvtransfer counters on both sides (send on the prefill worker,
recv on the decode worker, the write latency histogram), the token counters, the
layer-by-layer push (writes reach the decode worker before the prefill ends), 404
for other paths. The metrics server's contract without Stats (a worker still
loading) is checked in-process on loopback, and a taken port fails the worker clearly.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.net import free_port
from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc
from splitserve.metrics_http import MetricsApp, MetricsServer
from splitserve.services.worker.stats_metrics import (COUNTERS, GAUGES, VLLM_CACHE_CONFIG, VLLM_KV_USAGE,
                                                      VLLM_RUNNING, VLLM_WAITING, ServedModel, stats_reader)
from splitserve.testing.cluster import Cluster
from splitserve.testing.workers import generate, worker_stats

PROMPT = [(13 * i + 7) % 31000 + 5 for i in range(90)]    # over the threshold: prefilled remotely
MAX_TOKENS = 4
CHUNK = 256                                                # the prefill worker's per-step token budget
LONG_PROMPT = [(17 * i + 3) % 31000 + 5 for i in range(8 * CHUNK)]

Samples = dict[tuple[str, frozenset], float]


def _get(url: str, method: str = "GET") -> tuple[int, str]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _scrape(url: str) -> Samples:
    status, text = _get(url)
    assert status == 200, text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _series(samples: Samples, name: str) -> list[tuple[dict[str, str], float]]:
    return [(dict(ls), v) for (n, ls), v in samples.items() if n == name]


def _describe(address: str) -> worker_pb2.DescribeResponse:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=10)


def _value(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


@pytest.fixture(scope="module")
def workers(llama_dir):
    cluster = Cluster(llama_dir, transfer="tcp")
    bases = {}
    try:
        for name, role, extra in [("d0", "decode", ("--remote-prefill-threshold", "32")),
                                  ("p0", "prefill", ("--max-num-batched-tokens", str(CHUNK)))]:
            metrics_port = free_port()
            bases[name] = f"http://127.0.0.1:{metrics_port}"
            cluster.start_worker(name, role, "--metrics-port", str(metrics_port), *extra)
        for name, base in bases.items():
            cluster.workers[name].proc.wait_for_line(rf"worker {name} metrics on {base}/metrics", 60)
            # Served from the start, while the model may still be loading: 200 either way.
            assert _get(f"{base}/metrics")[0] == 200
        cluster.wait_workers()
        yield {name: (cluster.workers[name].address, base) for name, base in bases.items()}
    finally:
        codes = cluster.close(grace_s=30.0)
    assert codes == [0, 0] and not cluster.killed, cluster.outputs()[-6000:]


def test_disaggregated_request_shows_in_both_workers_metrics(workers):
    (d0, d0_http), (p0, p0_http) = workers["d0"], workers["p0"]
    before = {"d0": _scrape(f"{d0_http}/metrics"), "p0": _scrape(f"{p0_http}/metrics")}
    out = asyncio.run(generate(d0, "metrics-1", PROMPT, MAX_TOKENS, [("p0", p0)]))
    assert len(out.token_ids) == MAX_TOKENS
    assert out.prefilled_remotely
    after = {"d0": _scrape(f"{d0_http}/metrics"), "p0": _scrape(f"{p0_http}/metrics")}

    # One kv_usage gauge per worker, labelled with its id and role; every Stats family is there.
    for name, role in (("d0", "decode"), ("p0", "prefill")):
        usage = [(ls, v) for (n, ls), v in after[name].items() if n == "splitserve_worker_kv_usage"]
        assert usage == [(frozenset({("worker", name), ("role", role)}), 0.0)], usage   # idle again: no leak
        stats = worker_stats(workers[name][0])
        assert _value(after[name], "splitserve_worker_kv_blocks", worker=name) == stats.num_kv_blocks > 0
        for metric, _, _ in GAUGES:
            assert (metric, frozenset({("worker", name), ("role", role)})) in after[name], metric
        for metric, _, _ in COUNTERS:
            assert _value(after[name], f"{metric}_total", worker=name) >= 0
            assert (f"{metric}_total", frozenset({("worker", name), ("role", role)})) in after[name], metric

    def grew(name: str, metric: str, **labels: str) -> float:
        return _value(after[name], metric, **labels) - _value(before[name], metric, **labels)

    # The KV bytes went from the prefill worker (send) to the decode worker (recv); the sender
    # also counts the notification's payload (the first token).
    sent = grew("p0", "splitserve_kv_transfer_bytes_total", direction="send", backend="tcp")
    received = grew("d0", "splitserve_kv_transfer_bytes_total", direction="recv", backend="tcp")
    assert 0 < received <= sent < received + 64
    assert grew("p0", "splitserve_kv_transfer_seconds_count", backend="tcp") > 0
    assert grew("d0", "splitserve_kv_transfer_bytes_total", direction="send") == 0
    # Engine and worker counters, as the Stats RPC counts them.
    assert grew("p0", "splitserve_worker_prefills_served_total") == 1
    assert grew("p0", "splitserve_worker_prompt_tokens_computed_total") == len(PROMPT)
    assert grew("d0", "splitserve_worker_remote_prefills_total") == 1
    assert grew("d0", "splitserve_worker_generated_tokens_total") >= MAX_TOKENS - 1
    assert grew("d0", "splitserve_worker_requests_finished_total") == 1


def test_vllm_named_gauges_describe_each_worker_for_an_endpoint_picker(workers):
    """What llm-d's metrics extractor reads, one series per name, labelled with the model that
    Describe names: the queue, the running batch, the KV usage as a fraction, and the block size
    and count as labels of `vllm:cache_config_info`."""
    for name in ("d0", "p0"):
        address, base = workers[name]
        samples, stats, info = _scrape(f"{base}/metrics"), worker_stats(address), _describe(address)
        labels = {"model_name": info.model_name, "engine": "0"}
        assert info.model_name
        assert _series(samples, VLLM_WAITING) == [(labels, stats.num_waiting + stats.num_remote_prefill)]
        assert _series(samples, VLLM_RUNNING) == [(labels, stats.num_running)]
        assert _series(samples, VLLM_KV_USAGE) == [(labels, stats.kv_usage)]
        assert _series(samples, VLLM_CACHE_CONFIG) == [
            ({**labels, "block_size": str(info.block_size), "num_gpu_blocks": str(stats.num_kv_blocks)}, 1.0)]
        assert stats.num_kv_blocks > 0 and 0 <= stats.kv_usage <= 1


def test_layers_reach_the_decode_worker_while_the_prefill_still_computes(workers, llama_dir):
    """The push is layer by layer: the decode worker receives one write per layer per chunk,
    and receives the first ones before the prefill worker has computed the whole prompt."""
    (d0, d0_http), (p0, _) = workers["d0"], workers["p0"]
    num_layers = json.loads((llama_dir / "config.json").read_text())["num_hidden_layers"]

    def writes() -> float:
        return _value(_scrape(f"{d0_http}/metrics"), "splitserve_kv_transfers_total", direction="recv",
                      kind="write")

    async def main() -> list[tuple[float, int]]:
        writes_before, computed_before = writes(), worker_stats(p0).num_prompt_tokens_computed
        long = asyncio.create_task(generate(d0, "metrics-long", LONG_PROMPT, MAX_TOKENS, [("p0", p0)]))
        samples = []            # (writes received so far, prompt tokens computed so far), read in that order
        while not long.done():
            written = await asyncio.to_thread(writes)
            computed = (await asyncio.to_thread(worker_stats, p0)).num_prompt_tokens_computed
            samples.append((written - writes_before, computed - computed_before))
        out = await long
        assert len(out.token_ids) == MAX_TOKENS
        assert out.prefilled_remotely
        samples.append((writes() - writes_before, worker_stats(p0).num_prompt_tokens_computed - computed_before))
        return samples

    samples = asyncio.run(main())
    assert samples[-1][1] == len(LONG_PROMPT)
    assert samples[-1][0] >= num_layers * len(LONG_PROMPT) // CHUNK, samples[-1]
    assert any(written > 0 and computed < len(LONG_PROMPT) for written, computed in samples), samples


def test_other_paths_and_methods_are_refused(workers):
    for _, base in workers.values():
        assert _get(f"{base}/nope")[0] == 404
        assert _get(f"{base}/")[0] == 404
        assert _get(f"{base}/metrics", method="POST")[0] == 405
        status, body = _get(f"{base}/metrics", method="HEAD")
        assert status == 200 and body == ""


def test_without_stats_the_scrape_answers_the_registry_alone():
    """A worker still loading (or stopped) has no Stats: 200, no splitserve_worker_* or vllm: family."""
    stats: list[worker_pb2.StatsResponse | None] = [None]

    async def read_stats():
        return stats[0]

    async def main():
        read = stats_reader(read_stats, lambda: ServedModel("m", 16))
        server = await MetricsServer.start(MetricsApp(read), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.port}/metrics"
        try:
            loading = await asyncio.to_thread(_scrape, url)
            stats[0] = worker_pb2.StatsResponse(worker_id="w", role=worker_pb2.WORKER_ROLE_BOTH, num_kv_blocks=8,
                                                num_used_kv_blocks=2, kv_usage=0.25, num_generated_tokens=5)
            loaded = await asyncio.to_thread(_scrape, url)
        finally:
            await server.close()
        return loading, loaded

    loading, loaded = asyncio.run(main())
    assert not [n for n, _ in loading if n.startswith(("splitserve_worker_", "vllm:"))]
    assert any(n.startswith("process_") for n, _ in loading)       # the default registry is served
    assert _value(loaded, "splitserve_worker_kv_usage", worker="w", role="both") == 0.25
    assert _series(loaded, VLLM_KV_USAGE) == [({"model_name": "m", "engine": "0"}, 0.25)]
    assert _value(loaded, "splitserve_worker_kv_blocks_used", worker="w") == 2
    assert _value(loaded, "splitserve_worker_generated_tokens_total", worker="w") == 5


def test_a_taken_metrics_port_fails_the_worker_clearly(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = subprocess.run(["splitserve", "worker", "--model",
                               str(tmp_path / "never-loaded"), "--metrics-port", str(port)],
                              capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}" in proc.stderr and "--metrics-port" in proc.stderr
