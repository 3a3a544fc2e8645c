"""The autoscaler's live scrape (metrics_source.PodMetricsSource) against a real HTTP server
serving a frontend's /metrics (the frontend's own FrontendMetrics registry) and real gRPC
servers answering Stats, found through pod documents as the apiserver lists them."""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest

from splitserve.operator.builders import Owner
from splitserve.operator.metrics_source import PodMetricsSource, frontend_urls, worker_targets
from splitserve.operator.scaling_task import AutoscaleTarget
from splitserve.services.spec.serving_deployment import ServingDeploymentSpec
from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc
from splitserve.services.frontend.metrics import FrontendMetrics
from splitserve.services.planner import ReplicaCounts

OWNER = Owner("chat", "team", "uid-1")


class FrontendServer:
    """A real HTTP server whose /metrics is a FrontendMetrics registry's exposition."""

    def __init__(self):
        self.metrics = FrontendMetrics()
        metrics = self.metrics

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = metrics.exposition()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class StatsServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker_id: str):
        self.stats = worker_pb2.StatsResponse(worker_id=worker_id)

    async def Stats(self, request, context):
        return self.stats


def pod(name, labels, ready=True, ip="127.0.0.1", annotations=None, deleting=False):
    meta = {"name": name, "labels": {"splitserve.io/deployment": "chat", **labels}, "annotations": annotations or {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": "n1"},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def worker_pod(group, pool, address, ready=True, draining=False):
    labels = {"splitserve.io/pool": pool, "splitserve.io/role": pool, "splitserve.io/group": group,
              "splitserve.io/rank": "0", "splitserve.io/spec-hash": "h"}
    if draining:
        labels["splitserve.io/draining"] = "true"
    return pod(f"{group}-0", labels, ready=ready, ip="10.0.0.9",
               annotations={"splitserve.io/worker-address": address, "splitserve.io/group-size": "1"})


class PodList:
    def __init__(self, pods):
        self.pods = pods
        self.selectors = []

    async def list(self, path, label_selector=None, field_selector=None):
        assert path == "/api/v1/namespaces/team/pods"
        self.selectors.append(label_selector)
        return self.pods


def test_frontend_and_worker_targets_from_pods():
    pods = [pod("fe-a", {"splitserve.io/role": "frontend"}),
            pod("fe-b", {"splitserve.io/role": "frontend"}, ready=False),
            pod("fe-c", {"splitserve.io/role": "frontend"}, deleting=True),
            pod("fe-d", {"splitserve.io/role": "frontend"}, ip=None),
            worker_pod("chat-decode-a", "decode", "127.0.0.1:1"),
            worker_pod("chat-decode-b", "decode", "127.0.0.1:2", draining=True),
            worker_pod("chat-prefill-a", "prefill", "127.0.0.1:3", ready=False)]
    assert frontend_urls(pods, 8000) == {"fe-a": "http://127.0.0.1:8000/metrics"}
    assert worker_targets(pods, use_pod_ip=False) == {"chat-decode-a": ("decode", "127.0.0.1:1")}
    bare = worker_pod("chat-decode-c", "decode", "")
    assert worker_targets([bare], use_pod_ip=True) == {"chat-decode-c": ("decode", "10.0.0.9:50051")}
    assert worker_targets([bare], use_pod_ip=False) == {}


@pytest.fixture
def frontend():
    server = FrontendServer()
    yield server
    server.close()


def test_live_scrape_turns_two_readings_into_a_sample(frontend):
    async def scenario():
        servers, addresses, servicers = [], {}, {}
        for worker_id in ("decode-a", "prefill-a"):
            server = grpc.aio.server()
            servicers[worker_id] = StatsServicer(worker_id)
            worker_pb2_grpc.add_WorkerServicer_to_server(servicers[worker_id], server)
            addresses[worker_id] = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
            servers.append(server)
        try:
            pods = PodList([pod("fe-a", {"splitserve.io/role": "frontend"}),
                            worker_pod("chat-decode-a", "decode", addresses["decode-a"]),
                            worker_pod("chat-prefill-a", "prefill", addresses["prefill-a"]),
                            worker_pod("chat-decode-gone", "decode", "127.0.0.1:9")])   # nothing listens
            clock = iter([100.0, 110.0, 120.0, 130.0])
            # 5 s: on a busy machine a 1 s scrape of the local servers timed out (no sample). The
            # address nothing listens on is refused at once, so the wait never runs out here.
            source = PodMetricsSource(pods, use_pod_ip=False, timeout_s=5.0, clock=lambda: next(clock))
            spec = ServingDeploymentSpec.from_dict({"model": {"source": "m"}, "frontend": {"port": frontend.port}})
            target, replicas = AutoscaleTarget(OWNER, spec), ReplicaCounts.of_pools(1, 2)

            assert await source.sample(target, replicas) is None          # the baseline
            assert pods.selectors == ["splitserve.io/deployment=chat"]

            m = frontend.metrics
            for _ in range(5):
                m.requests.labels(api="chat", status="ok").inc()
                m.ttft.observe(0.3)
            m.requests.labels(api="chat", status="cancelled").inc()
            m.in_flight.set(2)
            m.admitted.inc(8)                                        # at admission (services/frontend/core.py)
            m.admitted_prompt_tokens.inc(800)
            m.prompt_tokens.inc(500)
            m.generation_tokens.inc(120)
            for _ in range(20):
                m.itl.observe(0.02)
            decode = servicers["decode-a"].stats
            decode.kv_usage, decode.num_running, decode.num_generated_tokens = 0.25, 3, 120
            prefill = servicers["prefill-a"].stats
            prefill.num_waiting, prefill.num_prompt_tokens_computed = 2, 500

            sample = await source.sample(target, replicas)
            assert sample is not None
            assert (sample.timestamp, sample.interval_s, sample.replicas) == (110.0, 10.0, replicas)
            assert sample.num_arrivals == 6 + 2                      # admitted: ended in the interval + in flight
            assert sample.prompt_tokens_mean == 100.0                # 800 prompt tokens over 8 admitted
            assert sample.output_tokens_mean == 20.0                 # 120 generated over 6 ended
            assert 0.25 < sample.ttft_p90_s <= 0.5 and 0.01 < sample.itl_p90_s <= 0.025
            by_id = {w.worker_id: w for w in sample.workers}
            assert set(by_id) == {"decode-a", "prefill-a"}           # the unreachable worker is left out
            assert (by_id["decode-a"].role, by_id["decode-a"].kv_usage, by_id["decode-a"].num_running_decodes,
                    by_id["decode-a"].num_generated_tokens) == ("decode", 0.25, 3, 120)
            assert (by_id["prefill-a"].role, by_id["prefill-a"].prefill_queue_tokens,
                    by_id["prefill-a"].num_prompt_tokens_computed) == ("prefill", 200, 500)

            # Another frontend pod appears: its counters would look like a burst: a new baseline.
            pods.pods.append(pod("fe-b", {"splitserve.io/role": "frontend"}))
            assert await source.sample(target, replicas) is None
            source.forget(OWNER.uid)
            assert source._deployments == {}
        finally:
            for server in servers:
                await server.stop(None)

    asyncio.run(scenario())


def test_no_sample_without_a_frontend_to_read(frontend):
    async def scenario():
        spec = ServingDeploymentSpec.from_dict({"model": {"source": "m"}, "frontend": {"port": frontend.port}})
        target = AutoscaleTarget(OWNER, spec)
        replicas = ReplicaCounts.of_pools(1, 1)
        none_ready = PodMetricsSource(PodList([pod("fe-a", {"splitserve.io/role": "frontend"}, ready=False)]))
        assert await none_ready.sample(target, replicas) is None
        closed = ServingDeploymentSpec.from_dict({"model": {"source": "m"}, "frontend": {"port": 9}})
        unreachable = PodMetricsSource(PodList([pod("fe-a", {"splitserve.io/role": "frontend"})]), timeout_s=1.0)
        assert await unreachable.sample(AutoscaleTarget(OWNER, closed), replicas) is None
        assert await unreachable.sample(AutoscaleTarget(OWNER, closed), replicas) is None

    asyncio.run(scenario())
