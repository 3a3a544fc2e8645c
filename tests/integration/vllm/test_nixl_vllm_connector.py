"""`splitserve serve --engine vllm --kv-connector nixl-vllm`: vLLM's own NixlConnector between a
prefill and a decode worker (services/worker/kv/handoff.py), the baseline and option of issue 39.

- Greedy outputs equal vLLM's own aggregated `LLM.generate` for prompts of 10 and 500 tokens,
  each prefilled by the prefill worker: the decode worker's vLLM counts their prompt tokens as
  read through its connector, not computed (its step stats: stat_counts.py).
- Several samples of one prompt (n = 2) take one prefill: the others fork once the KV was read.
- A client gone while the decode worker reads the KV (or as the prefill worker answers) leaves
  both workers idle, and the prompt served next is exact.
- Both workers describe the same handoff layout (the router pairs only those), and a decode
  worker whose prefill worker is gone prefills locally, token for token (the prefill worker's
  `splitserve serve` restarts it; the module's server is not used after that test).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import httpx
import openai
import pytest

from splitserve.testing.waiting import async_wait_until, wait_until
from splitserve.testing.workers import wait_idle, worker_stats

from .conftest import start_vllm_serve, stop_vllm_serve

MAX_TOKENS = 12
STATS_TIMEOUT_S = 30.0
IDLE_LIMIT_S = 60.0
TEXT = ("Rivers carry sediment from mountains to the sea, building deltas where the current slows and "
        "the land grows into the water year after year. ")
PROMPTS = {"short": (0, 10), "long": (20, 500), "samples": (30, 200), "cancel": (35, 1000),
           "after-kill": (40, 300)}


@pytest.fixture(scope="module")
def handoff_server(vllm_python):
    server = start_vllm_serve(vllm_python, "--kv-connector", "nixl-vllm", "--transfer", "nixl",
                              "--remote-prefill-threshold", "1", disaggregated=(1, 1),
                              vllm_args=("--max-num-batched-tokens", "512"))
    try:
        yield server
    finally:
        stop_vllm_serve(server)


@pytest.fixture(scope="module")
def prompts(tokenize) -> dict[str, list[int]]:
    ids = tokenize(TEXT * 40)
    return {name: ids[offset:offset + n] for name, (offset, n) in PROMPTS.items()}


@pytest.fixture(scope="module")
def expected(reference_generate, prompts) -> dict[str, list[int]]:
    return dict(zip(prompts, reference_generate(list(prompts.values()), MAX_TOKENS, ignore_eos=True)))


def _tokens(server, prompt: list[int]) -> list[int]:
    client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=300)
    reply = client.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    return reply.choices[0].token_ids


def test_both_workers_describe_vllms_handoff_layout(handoff_server):
    layouts = {name: handoff_server.describe(name) for name in ("prefill-0", "decode-0")}
    assert {d.transfer_backend for d in layouts.values()} == {"nixl-vllm"}
    assert layouts["prefill-0"].kv_transfer_layout == layouts["decode-0"].kv_transfer_layout
    assert layouts["decode-0"].kv_transfer_layout.startswith("handoff:nixl-vllm:")


def test_greedy_tokens_equal_vllm_generate_with_the_kv_read_over_nixl(handoff_server, prompts, expected):
    decode, prefill = handoff_server.workers["decode-0"], handoff_server.workers["prefill-0"]
    before, served = worker_stats(decode, STATS_TIMEOUT_S), worker_stats(prefill, STATS_TIMEOUT_S).num_prefills_served
    for name in ("short", "long"):
        assert _tokens(handoff_server, prompts[name]) == expected[name], name
    after = worker_stats(decode, STATS_TIMEOUT_S)
    assert after.num_remote_prefills - before.num_remote_prefills == 2
    assert after.num_prefill_fallbacks == before.num_prefill_fallbacks
    assert worker_stats(prefill, STATS_TIMEOUT_S).num_prefills_served - served == 2
    # The decode side's vLLM counts every prompt token as read through its connector (it recomputes
    # the last one for its logits), none as computed: the KV came over NIXL.
    assert after.num_prefix_hit_tokens - before.num_prefix_hit_tokens == len(prompts["short"]) + len(prompts["long"])
    assert after.num_prompt_tokens_computed - before.num_prompt_tokens_computed <= 2
    wait_idle(handoff_server.workers, IDLE_LIMIT_S, stats_timeout_s=STATS_TIMEOUT_S)


def test_two_samples_of_one_prompt_take_one_prefill_and_both_are_exact(handoff_server, prompts, expected):
    decode, prefill = handoff_server.workers["decode-0"], handoff_server.workers["prefill-0"]
    before, served = worker_stats(decode, STATS_TIMEOUT_S), worker_stats(prefill, STATS_TIMEOUT_S).num_prefills_served
    client = openai.OpenAI(base_url=handoff_server.openai_url, api_key="unused", max_retries=0, timeout=300)
    reply = client.completions.create(model="smollm2", prompt=prompts["samples"], max_tokens=MAX_TOKENS, n=2,
                                      temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [c.token_ids for c in sorted(reply.choices, key=lambda c: c.index)] == [expected["samples"]] * 2
    after = worker_stats(decode, STATS_TIMEOUT_S)
    assert after.num_remote_prefills - before.num_remote_prefills == 1
    assert worker_stats(prefill, STATS_TIMEOUT_S).num_prefills_served - served == 1
    # The second sample's prompt comes from vLLM's prefix cache, in whole blocks: it recomputes
    # the last, partial one (and the first sample at most its last token).
    bs, n = handoff_server.describe("decode-0").block_size, len(prompts["samples"])
    assert after.num_prompt_tokens_computed - before.num_prompt_tokens_computed <= 1 + n - (n - 1) // bs * bs
    wait_idle(handoff_server.workers, IDLE_LIMIT_S, stats_timeout_s=STATS_TIMEOUT_S)


def test_a_client_gone_during_the_kv_read_leaves_both_workers_idle(handoff_server, prompts, expected):
    decode, prefill = handoff_server.workers["decode-0"], handoff_server.workers["prefill-0"]
    served = worker_stats(prefill, STATS_TIMEOUT_S).num_prefills_served

    def reading_or_handed_off() -> bool:
        return (worker_stats(decode, STATS_TIMEOUT_S).num_remote_prefill > 0
                or worker_stats(prefill, STATS_TIMEOUT_S).num_prefills_served > served)

    async def leave_during_the_read() -> None:
        body = {"model": "smollm2", "prompt": prompts["cancel"], "max_tokens": MAX_TOKENS, "temperature": 0,
                "stream": True, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=300) as http:
            request = asyncio.create_task(http.post(f"{handoff_server.openai_url}/completions", json=body))
            await async_wait_until(reading_or_handed_off, timeout=120, interval=0.005,
                                   what="the prefill worker to hand the KV off")
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request

    asyncio.run(leave_during_the_read())
    # vLLM frees the prefill side's blocks once read, or when the decode side drops the request
    # unread (it notifies), else at the connector's 30-s lease: within IDLE_LIMIT_S either way.
    wait_idle(handoff_server.workers, IDLE_LIMIT_S, stats_timeout_s=STATS_TIMEOUT_S)
    assert _tokens(handoff_server, prompts["cancel"]) == expected["cancel"]
    wait_idle(handoff_server.workers, IDLE_LIMIT_S, stats_timeout_s=STATS_TIMEOUT_S)


def test_with_the_prefill_worker_gone_the_decode_worker_prefills_locally(handoff_server, prompts, expected):
    decode = handoff_server.workers["decode-0"]
    before = worker_stats(decode, STATS_TIMEOUT_S)
    [pid] = [pid for pid in handoff_server.proc.children()
             if "--worker-id\0prefill-0\0" in open(f"/proc/{pid}/cmdline").read()]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2],
               timeout=30, interval=0.05, what="the prefill worker to die")
    assert _tokens(handoff_server, prompts["after-kill"]) == expected["after-kill"]
    after = worker_stats(decode, STATS_TIMEOUT_S)
    # Sent to the dead worker and fallen back, or not sent at all once the frontend saw it gone.
    assert after.num_local_prefills - before.num_local_prefills == 1
    assert after.num_remote_prefills == before.num_remote_prefills
    wait_idle({"decode-0": decode}, IDLE_LIMIT_S, stats_timeout_s=STATS_TIMEOUT_S)
