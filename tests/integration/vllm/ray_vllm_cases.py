"""The Ray Serve target with a vLLM pool (run by test_ray_serve_vllm.py in a network namespace).

One local Ray and one application from a ServingDeployment manifest with `engine: vllm`: one
aggregated vLLM worker replica (its worker is the replica's child process with the vLLM engine
environment's python). vLLM's own `LLM.generate` computes the reference while Ray starts. The
cases run in file order (the last one kills the replica):

1. the official openai client gets vLLM's greedy tokens from the replica;
2. killing the replica's actor mid-stream kills its vLLM worker (the death signal), the frontend
   migrates the stream to Serve's replacement replica, and the client gets the whole greedy output.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from splitserve.net import free_port
from splitserve.services.launch.probes import worker_serving
from splitserve.testing.metrics import scrape
from splitserve.testing.ray_netns import start_ray
from splitserve.testing.waiting import wait_until

READY_TIMEOUT_S = 600.0        # vLLM loads in ~30 s alone; several times that beside the reference on 2 cores
MAX_MODEL_LEN = 2048
SHORT = "The capital of France is"
KILL_PROMPT = "A long story about a lighthouse keeper and the storms of the northern coast"
SHORT_TOKENS = 16
KILL_MAX_TOKENS = 160          # room to kill mid-stream, and a continuation after the migration
APP = "splitserve"


def manifest(port: int) -> dict:
    return {"apiVersion": "splitserve.io/v1alpha1", "kind": "ServingDeployment", "metadata": {"name": "v"},
            "spec": {"engine": "vllm", "model": {"source": "smollm2", "dtype": "float32"},
                     "frontend": {"replicas": 1, "port": port}, "router": {"policy": "kv"},
                     "prefill": {"replicas": 0},
                     "decode": {"replicas": 1, "gpusPerRank": 0, "resources": {"cpu": "1", "memory": "1Gi"},
                                "engineArgs": ["--max-model-len", str(MAX_MODEL_LEN)]},
                     "migrationLimit": 3}}


def _client(base_url: str):
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=READY_TIMEOUT_S)


class Reference:
    """vLLM's own greedy tokens (conftest's vllm_generate), computed on a thread while Ray starts."""

    def __init__(self, generate, prompts: list[list[int]]):
        self.result: list[list[int]] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(generate, prompts), daemon=True)
        self._thread.start()

    def _run(self, generate, prompts) -> None:
        try:
            # one LLM.generate (one vLLM load): a greedy output's first tokens do not depend on max_tokens
            self.result = generate(prompts, KILL_MAX_TOKENS, True)
        except BaseException as exc:  # noqa: BLE001 - re-raised in get()
            self.error = exc

    def get(self) -> list[list[int]]:
        self._thread.join(READY_TIMEOUT_S)
        if self.error is not None:
            raise self.error
        assert self.result is not None, "vLLM's reference did not finish"
        return self.result


@pytest.fixture(scope="module")
def prompts(tokenize) -> list[list[int]]:
    return [tokenize(SHORT), tokenize(KILL_PROMPT)]


@pytest.fixture(scope="module")
def ray_app(vllm_python, reference_generate, prompts):
    import ray
    from ray import serve

    from splitserve.services.ray_serve.config import config_from_spec, read_spec
    from splitserve.services.ray_serve.launch import deploy
    from splitserve.services.ray_serve.settings import EngineSettings

    reference = Reference(reference_generate, prompts)
    scratch = Path(os.environ.get("SPLITSERVE_RAY_SCRATCH") or "/tmp")
    port = free_port()
    path = scratch / "deployment.yaml"
    path.write_text(yaml.safe_dump(manifest(port)))
    config = config_from_spec(read_spec(path), EngineSettings("smollm2", kv_cache_gib=1, engine_python=vllm_python),
                              migration_wait_s=READY_TIMEOUT_S)
    started = time.monotonic()
    start_ray(num_cpus=4, include_dashboard=False, _temp_dir=os.environ.get("RAY_TMPDIR"))
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        deploy(config, READY_TIMEOUT_S)
        print(f"ray.init + serve.start + deploy of a vLLM replica: {time.monotonic() - started:.1f} s",
              file=sys.stderr)
        yield f"http://127.0.0.1:{port}/v1", reference
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def directory() -> list:
    from ray import serve

    handle = serve.get_deployment_handle("WorkerDirectory", app_name=APP)
    return handle.members.remote().result(timeout_s=30)


def _migrations(base_url: str) -> float:
    return scrape(base_url.removesuffix("/v1") + "/metrics", "splitserve_migrations_total", outcome="migrated")


def test_a_vllm_replica_answers_with_vllms_greedy_tokens(ray_app, prompts):
    base_url, reference = ray_app
    client = _client(base_url)
    name = client.models.list().data[0].id
    reply = client.completions.create(model=name, prompt=prompts[0], max_tokens=SHORT_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    assert reply.choices[0].token_ids == reference.get()[0][:SHORT_TOKENS]
    [entry] = directory()
    assert entry.role == "both"


def test_killing_the_vllm_replica_mid_stream_is_survived_by_migration(ray_app, prompts):
    import ray

    base_url, reference = ray_app
    expected = reference.get()[1]
    [victim] = directory()
    killed: list[int] = []
    client = _client(base_url)
    stream = client.completions.create(model=client.models.list().data[0].id, prompt=prompts[1],
                                       max_tokens=KILL_MAX_TOKENS, temperature=0, stream=True,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    ids: list[int] = []
    for chunk in stream:
        if chunk.choices:
            ids.extend((chunk.choices[0].model_extra or {}).get("token_ids") or [])
        if not killed and len(ids) >= 10:
            ray.kill(ray.get_actor(victim.actor_name, namespace="serve"), no_restart=True)
            killed.append(len(ids))
            # The replica's vLLM worker (its child) died with the actor: nothing serves at its address.
            wait_until(lambda: not worker_serving(victim.address), timeout=30, interval=0.1,
                       what="the killed replica's vLLM worker to die with its actor")
    assert killed and killed[0] < KILL_MAX_TOKENS - 50, f"killed too late to matter: {killed}"
    assert ids == expected
    assert _migrations(base_url) >= 1
    [replacement] = directory()
    assert replacement.worker_id != victim.worker_id
