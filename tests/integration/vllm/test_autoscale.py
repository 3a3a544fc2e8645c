"""`splitserve serve --engine vllm --autoscale`: the planner's start-up profile run on a vLLM worker
(random-token prompts, each under a cache salt of its own, straight through the worker's gRPC
Generate; the KV capacity from its Describe), then serving as usual. One vLLM worker, autoscaled
between 1 and 2 in the one pool a vLLM worker serves (aggregated: --autoscale-mode fixed)."""

from __future__ import annotations

import os
import re

import httpx
import openai
import pytest

from .conftest import start_vllm_serve, stop_vllm_serve, vllm_worker_pid

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm")]

PINNED = str(min(os.sched_getaffinity(0)))
PROFILE = re.compile(r"autoscale: worker-0's profile: prefill (.*?); decode (.*?); KV (\d+) tokens; "
                     r"start-up ([\d.]+) s")


@pytest.fixture(scope="module")
def autoscaled(vllm_python):
    # Pinned (--cpu-cores): serve leaves vLLM workers unpinned unless asked.
    server = start_vllm_serve(vllm_python, "--autoscale", "--max-workers", "2", "--cpu-cores", PINNED)
    try:
        yield server
    finally:
        stop_vllm_serve(server)


def test_serve_engine_vllm_autoscale_is_ready_with_a_profile_of_its_vllm_worker(autoscaled):
    match = PROFILE.search(autoscaled.proc.output)
    assert match, autoscaled.proc.output
    prefill, decode, kv_tokens, startup = match.groups()
    d = autoscaled.describe()
    assert int(kv_tokens) == d.num_kv_blocks * d.block_size > 0        # vLLM's KV pool, from Describe
    assert re.fullmatch(r"(\d+ tokens \d+ tok/s)(, \d+ tokens \d+ tok/s)*", prefill), prefill
    assert "64 tokens" in prefill and "batch 1 " in decode and float(startup) > 0
    assert "; mode aggregated" in autoscaled.proc.output        # --autoscale-mode fixed: one pool, no switch
    # the profile's random prompts left nothing running, and the server answers (openai and raw HTTP)
    client = openai.OpenAI(base_url=autoscaled.openai_url, api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    reply = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                      temperature=0)
    assert reply.usage.completion_tokens == 4
    raw = httpx.post(f"{autoscaled.base_url}/v1/completions", timeout=300,
                     json={"model": model, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0})
    assert raw.status_code == 200 and raw.json()["usage"]["completion_tokens"] == 2, raw.text


def test_a_vllm_worker_given_cpu_cores_runs_every_thread_on_them(autoscaled):
    """vLLM binds threads only in its multiprocess executor's processes; in the worker's process the
    worker pins itself: every thread, vLLM's and torch's and gRPC's, on --cpu-cores."""
    worker = vllm_worker_pid(autoscaled)
    tasks = os.listdir(f"/proc/{worker}/task")
    assert len(tasks) > 3
    for tid in tasks:
        assert os.sched_getaffinity(int(tid)) == {int(PINNED)}, tid
