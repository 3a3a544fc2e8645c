"""`splitserve serve --engine vllm` answers greedy requests token for token as vLLM's own
`LLM.generate` does on the same weights: short prompts, a ~1,000-token one, and 8 at once,
through the official openai client and through the public gRPC endpoint."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from splitserve.proto.v1 import inference_pb2, inference_pb2_grpc

MAX_TOKENS = 24
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "In 1969, the first humans to walk on the Moon were",
    "A haiku about autumn leaves:",
    "To make a cup of tea, first",
]
LONG_TEXT = ("The history of the printing press begins with movable type in East Asia and continues with "
             "Gutenberg's press in Mainz, which spread across Europe within decades. ") * 30 + "In summary,"


@pytest.fixture(scope="module")
def prompts(tokenize) -> list[list[int]]:
    ids = [tokenize(text) for text in TEXTS] + [tokenize(LONG_TEXT)]
    assert 900 <= len(ids[-1]) <= 1500, len(ids[-1])
    return ids


@pytest.fixture(scope="module")
def expected(reference_generate, prompts) -> list[list[int]]:
    """vLLM's own greedy tokens for every prompt (one LLM.generate batch)."""
    return reference_generate(prompts, MAX_TOKENS)


def _openai_tokens(client: openai.OpenAI, prompt: list[int]) -> list[int]:
    reply = client.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True})
    [choice] = reply.choices
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(choice.token_ids)
    return choice.token_ids


def _grpc_tokens(address: str, prompt: list[int]) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        replies = list(stub.Generate(inference_pb2.GenerateRequest(
            token_ids=inference_pb2.TokenIds(ids=prompt), max_tokens=MAX_TOKENS, temperature=0,
            include_usage=True), timeout=300))
    assert replies[-1].usage.prompt_tokens == len(prompt)
    return [t for r in replies for t in r.token_ids]


def test_openai_client_greedy_tokens_equal_vllm_generate(vllm_server, prompts, expected):
    client = openai.OpenAI(base_url=vllm_server.openai_url, api_key="unused", max_retries=0, timeout=300)
    alone = [_openai_tokens(client, prompts[0]), _openai_tokens(client, prompts[-1])]   # one at a time
    assert alone == [expected[0], expected[-1]]
    with ThreadPoolExecutor(len(TEXTS)) as pool:       # the 8 short prompts at once
        together = list(pool.map(lambda p: _openai_tokens(client, p), prompts[:len(TEXTS)]))
    assert together == expected[:len(TEXTS)]


def test_grpc_greedy_tokens_equal_vllm_generate(vllm_server, prompts, expected):
    with ThreadPoolExecutor(len(prompts)) as pool:     # all nine at once, the long one among them
        got = list(pool.map(lambda p: _grpc_tokens(vllm_server.grpc_address, p), prompts))
    assert got == expected



def test_serve_leaves_its_vllm_worker_unpinned_with_vllms_one_torch_thread(vllm_server):
    """By default serve pins no vLLM worker (docs/engines.md: measured better on 2 cores); vLLM in the
    worker's process computes on one torch thread. test_autoscale.py pins one with --cpu-cores."""
    import os

    from .conftest import vllm_worker_pid

    worker = vllm_worker_pid(vllm_server)
    argv = open(f"/proc/{worker}/cmdline").read().split("\0")
    assert "--cpu-cores" not in argv
    for tid in os.listdir(f"/proc/{worker}/task"):
        assert os.sched_getaffinity(int(tid)) == os.sched_getaffinity(0), tid
