"""n > 1 as one worker request (forks) through real workers and the official `openai`
client: over 1P+1D the prefill worker prefills the prompt once for all n choices; when the
decode worker serving the n choices is killed mid-stream, each choice continues on the
other worker on its own and still samples exactly what it samples without the fault."""

from __future__ import annotations

import asyncio
import signal

import openai

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.testing.models import random_prompt
from splitserve.testing.workers import wait_idle

from .conftest import DECODE_FLAGS, FRONTEND_FLAGS, MODEL_NAME

N = 4
SEED = 77


def _expected(llama_dir, prompt: list[int], max_tokens: int) -> list[list[int]]:
    """Each choice alone (seed + i), on an engine in this process: the fault-free samples."""
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=256, num_threads=1))
    try:
        params = [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=SEED + i, ignore_eos=True)
                  for i in range(N)]
        return [r.token_ids for r in engine.generate([prompt] * N, params)]
    finally:
        engine.close()


def _body(prompt: list[int], max_tokens: int) -> dict:
    return dict(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.8, seed=SEED, n=N,
                extra_body={"ignore_eos": True, "return_token_ids": True})


def test_n_choices_over_1p1d_prefill_once_on_the_prefill_worker(cluster, llama_dir):
    prompt = random_prompt(1, 100)                    # 100 uncached tokens: worth a remote prefill
    expected = _expected(llama_dir, prompt, 8)
    p0 = cluster.start_worker("p0", "prefill")
    d0 = cluster.start_worker("d0", "decode", *DECODE_FLAGS)
    cluster.wait_workers()
    front = cluster.start_frontend(*FRONTEND_FLAGS)
    front.wait_ready()
    client = openai.OpenAI(base_url=front.openai_url, api_key="unused", max_retries=0, timeout=60)
    out = client.completions.create(**_body(prompt, 8))
    assert [c.index for c in out.choices] == list(range(N))
    assert [c.token_ids for c in out.choices] == expected
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (100, N * 8)
    p, d = p0.stats(), d0.stats()
    assert p.num_prefills_served == 1 and p.num_prompt_tokens_computed == 100     # one prefill
    assert d.num_requests == 1 and d.num_remote_prefills == 1 and d.num_local_prefills == 0
    # The decode worker forked the received KV: 3 samples sharing (100 - 1) // 16 = 6 full
    # blocks, each with its copy of the last token's block, recomputing that token alone.
    assert (d.num_forks, d.num_forked_kv_blocks, d.num_fork_copies) == (3, 18, 3)
    assert d.num_prompt_tokens_computed == 3
    wait_idle([p0, d0], 2.0)


def test_sigkill_mid_stream_continues_each_choice_on_its_own(cluster, llama_dir):
    prompt = random_prompt(2, 40)
    max_tokens = 80
    expected = _expected(llama_dir, prompt, max_tokens)
    w0 = cluster.start_worker("w0", "both")
    w1 = cluster.start_worker("w1", "both")
    cluster.wait_workers()
    front = cluster.start_frontend(*FRONTEND_FLAGS)
    front.wait_ready()
    streamed: dict[int, list[int]] = {i: [] for i in range(N)}
    finish: dict[int, str] = {}
    usage = []
    killed = []

    async def run() -> None:
        async with openai.AsyncOpenAI(base_url=front.openai_url, api_key="unused", max_retries=0,
                                      timeout=120) as client:
            stream = await client.completions.create(stream=True, stream_options={"include_usage": True},
                                                     **_body(prompt, max_tokens))
            async with stream:
                async for chunk in stream:
                    if chunk.usage is not None:
                        usage.append(chunk.usage)
                    for c in chunk.choices:
                        streamed[c.index] += getattr(c, "token_ids", None) or []
                        if c.finish_reason:
                            finish[c.index] = c.finish_reason
                    if not killed and min(len(t) for t in streamed.values()) >= 3:
                        serving = [w for w in (w0, w1) if w.stats().num_running > 0]
                        assert len(serving) == 1 and serving[0].stats().num_running == N
                        serving[0].proc.process.send_signal(signal.SIGKILL)
                        killed.append(serving[0])

    asyncio.run(run())
    assert killed, "the stream finished before the kill"
    assert [streamed[i] for i in range(N)] == expected
    assert finish == {i: "length" for i in range(N)}
    assert (usage[-1].prompt_tokens, usage[-1].completion_tokens) == (40, N * max_tokens)
    assert front.metric("splitserve_migrations_total", outcome="migrated") == N   # each choice alone
    survivor = w1 if killed[0] is w0 else w0
    assert survivor.stats().num_requests == N
    wait_idle([survivor], 2.0)
