"""The Ray Serve target against `splitserve serve` (run by test_ray_serve.py in a network namespace).

One module-wide local Ray and one application (1 prefill, 2 decode workers, a
random Llama), deployed from a ServingDeployment manifest. The reference is a
real `splitserve serve` on the same model and flags, loading while Ray starts
and stopped once measured.
The cases run in file order (the last one kills a replica):

1. the official openai client gets token-exact greedy output equal to the
   reference (chat streamed, completion not streamed, a prompt long enough
   to be prefilled remotely);
2. redeploying the manifest with another decode count scales the pool in
   place (the surviving replicas are the same actors) up and then down;
3. a request prefilled remotely, sent with a client's `traceparent`, is one trace
   across the ingress and both workers' replicas (the manifest's
   `tracing.otlpTracesEndpoint`, a real OTLP receiver in this namespace);
4. killing the decode replica's actor that serves a stream mid-stream: the
   client still gets the whole greedy output (migration), the frontend counts
   a migration, and Serve replaces the replica.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml

from splitserve.net import free_port
from splitserve.testing.metrics import scrape
from splitserve.testing.ray_netns import start_ray
from splitserve.testing.otlp_collector import OtlpCollector
from splitserve.testing.waiting import wait_until

READY_TIMEOUT_S = 120.0
KV_CACHE_GIB = 0.05
THRESHOLD = 8            # prompts with more uncached tokens than this are prefilled remotely
LONG_PROMPT = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen"
TRACED_PROMPT = "a traced request about rivers, mountains, deserts, forests, glaciers and the open sea"   # uncached
CHAT = [{"role": "user", "content": "Tell me about the sea and the ships that sail on it."}]
KILL_PROMPT = "A long story about a lighthouse keeper and the storms of the northern coast"
KILL_MAX_TOKENS = 600    # seconds of decoding on these CPUs: room to kill mid-stream
APP = "splitserve"


def manifest(model: str, num_decode: int, port: int, traces_endpoint: str) -> dict:
    pool = {"gpusPerRank": 0, "resources": {"cpu": "1", "memory": "256Mi"}}
    return {"apiVersion": "splitserve.io/v1alpha1", "kind": "ServingDeployment", "metadata": {"name": "t"},
            "spec": {"model": {"source": model, "dtype": "float32"}, "frontend": {"replicas": 1, "port": port},
                     "router": {"policy": "kv"}, "prefill": {"replicas": 1, **pool},
                     "decode": {"replicas": num_decode, **pool},
                     "disaggregationThreshold": THRESHOLD, "migrationLimit": 3,
                     "tracing": {"otlpTracesEndpoint": traces_endpoint}}}


# -- the client side, the same for both targets ------------------------------------------------------

def _client(base_url: str):
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def _stream_ids(stream, on_chunk=None) -> list[int]:
    ids: list[int] = []
    for n, chunk in enumerate(stream):
        if chunk.choices:
            ids.extend((chunk.choices[0].model_extra or {}).get("token_ids") or [])
        if on_chunk is not None:
            on_chunk(n, ids)
    return ids


def greedy_outputs(base_url: str, model: str) -> dict[str, list[int]]:
    client = _client(base_url)
    extra = {"return_token_ids": True}
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0, stream=True,
                                          extra_body=extra)
    completion = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=24, temperature=0,
                                           extra_body=extra)
    return {"chat": _stream_ids(chat), "completion": completion.choices[0].model_extra["token_ids"]}


def long_stream(base_url: str, model: str, on_chunk=None) -> list[int]:
    stream = _client(base_url).completions.create(
        model=model, prompt=KILL_PROMPT, max_tokens=KILL_MAX_TOKENS, temperature=0, stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    return _stream_ids(stream, on_chunk)


# -- the reference: `splitserve serve` ------------------------------------------------------------

class ReferenceServer:
    """`splitserve serve` on the same model and flags; started before Ray so both load at once."""

    def __init__(self, model: str):
        self.port = free_port()
        argv = ["splitserve", "serve", "--model", model, "--dtype", "float32", "--port", str(self.port),
                "--grpc-port", "0", "--prefill-workers", "1", "--decode-workers", "1",
                "--remote-prefill-threshold", str(THRESHOLD), "--kv-cache-gib", str(KV_CACHE_GIB), "--threads", "1"]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")), daemon=True).start()

    def outputs(self) -> tuple[str, dict[str, list[int]], list[int]]:
        """(model name, greedy_outputs, long_stream) once it is ready."""
        wait_until(lambda: any("splitserve is ready" in line for line in self.lines) or self.proc.poll() is not None,
                   timeout=READY_TIMEOUT_S, what="the reference serve to be ready", details=lambda: "".join(self.lines))
        assert self.proc.poll() is None, "".join(self.lines)
        base = f"http://127.0.0.1:{self.port}/v1"
        name = _client(base).models.list().data[0].id
        result = name, greedy_outputs(base, name), long_stream(base, name)
        print(f"reference `splitserve serve` ready and measured after {time.monotonic() - self.started:.1f} s",
              file=sys.stderr)
        return result

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(30) == 0, "".join(self.lines)


# -- Ray -------------------------------------------------------------------------------------------

class RayApp:
    def __init__(self, model: str, scratch: Path, collector: OtlpCollector):
        self.model = model
        self.scratch = scratch
        self.collector = collector
        self.port = free_port()

    def deploy(self, num_decode: int):
        from splitserve.services.ray_serve.config import config_from_spec, read_spec
        from splitserve.services.ray_serve.launch import deploy
        from splitserve.services.ray_serve.settings import EngineSettings

        path = self.scratch / f"deployment-{num_decode}.yaml"
        path.write_text(yaml.safe_dump(manifest(self.model, num_decode, self.port, self.collector.endpoint)))
        config = config_from_spec(read_spec(path), EngineSettings(self.model, kv_cache_gib=KV_CACHE_GIB, threads=1))
        return deploy(config, READY_TIMEOUT_S)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def directory(self, role: str) -> list:
        from ray import serve

        handle = serve.get_deployment_handle("WorkerDirectory", app_name=APP)
        return [e for e in handle.members.remote().result(timeout_s=30) if e.role == role]

    def running(self, deployment: str) -> int:
        from ray import serve

        status = serve.status().applications[APP].deployments[deployment]
        return status.replica_states.get("RUNNING", 0)

    def wait_running(self, deployment: str, n: int, timeout: float = READY_TIMEOUT_S) -> None:
        wait_until(lambda: self.running(deployment) == n, timeout=timeout, interval=0.2,
                   what=f"{n} running replicas of {deployment}", details=serve_status)


def serve_status() -> str:
    from ray import serve

    return str(serve.status().applications.get(APP))


@pytest.fixture(scope="module")
def reference_server(llama_dir):
    server = ReferenceServer(str(llama_dir))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def collector():
    with OtlpCollector.start() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def ray_app(llama_dir, reference_server, collector):
    import ray
    from ray import serve

    scratch = Path(os.environ.get("SPLITSERVE_RAY_SCRATCH") or "/tmp")
    started = time.monotonic()
    # OTEL_BSP_SCHEDULE_DELAY: spans leave each replica within 0.1 s of ending.
    start_ray(num_cpus=8, include_dashboard=False, _temp_dir=os.environ.get("RAY_TMPDIR"),
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "OTEL_BSP_SCHEDULE_DELAY": "100"}})
    print(f"ray.init: {time.monotonic() - started:.1f} s", file=sys.stderr)
    try:
        app = RayApp(str(llama_dir), scratch, collector)
        serve.start(http_options={"host": "127.0.0.1", "port": app.port})
        app.deploy(num_decode=2)
        print(f"ray.init + serve.start + deploy: {time.monotonic() - started:.1f} s", file=sys.stderr)
        yield app
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def reference(reference_server, ray_app):
    """The reference's outputs, measured once Ray is up too (both started loading together)."""
    try:
        return reference_server.outputs()
    finally:
        reference_server.stop()


def test_greedy_output_equals_splitserve_serve(ray_app, reference):
    name, expected, _ = reference
    got = greedy_outputs(ray_app.base_url, name)
    assert got == expected
    assert all(len(ids) == 24 for ids in got.values())


def test_a_request_is_one_trace_across_the_ingress_and_both_workers(ray_app, reference, collector):
    name = reference[0]
    trace_id, client_span_id = secrets.token_hex(16), secrets.token_hex(8)
    out = _client(ray_app.base_url).completions.create(
        model=name, prompt=TRACED_PROMPT, max_tokens=4, temperature=0,     # prefilled remotely
        extra_headers={"traceparent": f"00-{trace_id}-{client_span_id}-01"})
    assert out.usage.completion_tokens == 4

    def whole():
        spans = collector.trace(trace_id)
        names = {s.name for s in spans}
        return spans if {"llm_request", "route", "worker_call", "generate", "remote_prefill", "prefill",
                         "kv_transfer", "decode"} <= names else None
    spans = wait_until(whole, timeout=30, what=f"every span of trace {trace_id}",
                       details=lambda: sorted((s.service, s.instance, s.name) for s in collector.trace(trace_id)))
    by_name = {s.name: s for s in spans}
    root = by_name["llm_request"]
    assert root.service == "splitserve-frontend" and root.parent_span_id == client_span_id
    generate, prefill = by_name["generate"], by_name["prefill"]
    assert generate.service == prefill.service == "splitserve-worker"
    assert generate.parent_span_id == by_name["worker_call"].span_id
    assert prefill.parent_span_id == by_name["remote_prefill"].span_id
    decoders = {e.worker_id for e in ray_app.directory("decode")}
    [prefiller] = [e.worker_id for e in ray_app.directory("prefill")]
    assert generate.instance in decoders and prefill.instance == prefiller      # one trace, both replicas
    assert not [s for s in spans if s.status_code == 2]


def test_scaling_a_pool_through_the_config(ray_app):
    before = {e.actor_name for e in ray_app.directory("decode")}
    assert len(before) == 2 and ray_app.running("DecodeWorker") == 2
    ray_app.deploy(num_decode=3)
    assert ray_app.running("DecodeWorker") == 3
    after = {e.actor_name for e in ray_app.directory("decode")}
    assert len(after) == 3 and before < after          # scaled in place: the two old workers stayed
    assert ray_app.running("PrefillWorker") == 1
    ray_app.deploy(num_decode=2)
    assert ray_app.running("DecodeWorker") == 2
    assert len(ray_app.directory("decode")) == 2


def _worker_in_flight(address: str) -> int:
    from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=5).num_in_flight


def _migrations(base_url: str) -> float:
    return scrape(base_url.removesuffix("/v1") + "/metrics", "splitserve_migrations_total", outcome="migrated")


def test_killing_a_decode_replica_mid_stream_is_survived_by_migration(ray_app, reference):
    import ray

    name, _, expected = reference
    decoders = ray_app.directory("decode")
    assert len(decoders) == 2
    killed: list = []

    def kill_serving_replica(n: int, ids: list[int]) -> None:
        if killed or len(ids) < 20:
            return
        [victim] = [e for e in decoders if _worker_in_flight(e.address) > 0]
        ray.kill(ray.get_actor(victim.actor_name, namespace="serve"), no_restart=True)
        killed.append((victim, len(ids)))

    got = long_stream(ray_app.base_url, name, kill_serving_replica)
    assert killed, "the stream ended before a replica could be killed"
    victim, at = killed[0]
    assert at < KILL_MAX_TOKENS - 50, f"killed too late to matter ({at} tokens in)"
    assert got == expected
    assert _migrations(ray_app.base_url) >= 1
    ray_app.wait_running("DecodeWorker", 2)     # Serve replaced the killed replica
    def replaced() -> bool:
        decoders = ray_app.directory("decode")
        return victim.worker_id not in {e.worker_id for e in decoders} and len(decoders) == 2

    wait_until(replaced, timeout=READY_TIMEOUT_S, interval=0.2, what="the replacement in the directory, not the victim",
               details=lambda: ray_app.directory("decode"))
