"""One vLLM worker behind `splitserve serve --engine vllm`: what it refuses (sampling parameters
vLLM cannot honour, named in an INVALID_ARGUMENT; a prompt beyond vLLM's context, a 400 with an
OpenAI error body) while it keeps serving, that a client's disconnect frees vLLM's KV blocks,
and that a repeated long prompt reports vLLM's prefix-cache hits as `cached_tokens`.

The parameters vLLM cannot honour reach a worker only from a frontend's migration (a client's
OpenAI request cannot set them, and the ranges vLLM checks are the OpenAI API's, which the
frontend checks first), so they are sent to the worker's own gRPC API here."""

from __future__ import annotations

import json
import time

import grpc
import httpx
import openai
import pytest

from splitserve.proto.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from splitserve.testing.workers import wait_idle, worker_stats


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.openai_url}/completions", json={"model": "smollm2", **body}, timeout=300)


def _assert_serves(server) -> None:
    reply = _post(server, {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4


def _worker_generate(address: str, request_id: str, prompt: list[int], **params) -> list:
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        request = worker_pb2.TokenGenerateRequest(request_id=request_id, token_ids=prompt,
                                                  params=common_pb2.SamplingParams(**params))
        return list(stub.Generate(request, timeout=300))


@pytest.mark.parametrize("params, named", [
    # What a migration sends for a seeded sampled request: vLLM's generator cannot skip draws.
    ({"seed": 7, "temperature": 0.8, "num_prior_draws": 3}, "num_prior_draws"),
    # vLLM counts only its own tokens as output for presence/frequency penalties.
    ({"presence_penalty": 0.5, "num_prior_output_tokens": 2}, "num_prior_output_tokens"),
])
def test_parameters_vllm_cannot_honour_are_refused_naming_them(vllm_server, tokenize, params, named):
    [worker] = vllm_server.workers.values()
    prompt = tokenize("The capital of France is")
    with pytest.raises(grpc.RpcError) as refused:
        _worker_generate(worker, f"refused-{named}", prompt, max_tokens=4, **params)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    assert f"parameter={named}" in refused.value.details(), refused.value.details()
    # Without the refused part the same request is served, and so is the next client.
    served = _worker_generate(worker, f"served-{named}", prompt, max_tokens=4,
                              **{k: v for k, v in params.items() if k != named})
    assert served[-1].finished and sum(len(r.token_ids) for r in served) == 4
    _assert_serves(vllm_server)


def test_prompt_longer_than_max_model_len_is_a_400(vllm_server, tokenize):
    limit = vllm_server.describe().max_model_len
    assert limit == vllm_server.max_model_len           # vLLM's own, from `-- --max-model-len`
    prompt = tokenize("word " * (limit + 100))
    assert len(prompt) > limit
    reply = _post(vllm_server, {"prompt": prompt, "max_tokens": 4})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert str(limit) in error["message"] and str(len(prompt)) in error["message"], error
    _assert_serves(vllm_server)


def test_client_disconnect_frees_vllms_blocks(vllm_server, tokenize):
    [worker] = vllm_server.workers.values()
    prompt = tokenize("A long story about a lighthouse keeper and the storm. " * 40)
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=300) as http:
        with http.stream("POST", f"{vllm_server.openai_url}/completions", json=body) as reply:
            assert reply.status_code == 200
            lines = reply.iter_lines()      # kept open: leaving a `for` over it would close the connection
            chunks = 0
            while chunks < 3:
                line = next(lines)
                chunks += line.startswith("data: {") and bool(json.loads(line[6:])["choices"])
            held = worker_stats(worker)
            block = vllm_server.describe().block_size
            assert held.num_running == 1 and held.num_used_kv_blocks >= len(prompt) // block, held
            assert worker_stats(worker).num_running == 1        # still generating while we are connected
        # leaving the blocks closes the connection mid-stream
    gone = time.monotonic()
    stats = wait_idle({"worker-0": worker}, 60.0, since=gone).stats["worker-0"]
    assert stats.num_used_kv_blocks == 0 and stats.num_running == 0, stats
    _assert_serves(vllm_server)


def test_repeated_long_prompt_reports_cached_tokens(vllm_server, tokenize):
    client = openai.OpenAI(base_url=vllm_server.openai_url, api_key="unused", max_retries=0, timeout=300)
    prompt = tokenize("Notes on the migration of arctic terns, season by season. " * 60)
    first = client.completions.create(model="smollm2", prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model="smollm2", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == len(prompt)
    cached = second.usage.prompt_tokens_details.cached_tokens
    block = vllm_server.describe().block_size
    assert cached >= (len(prompt) - 1) // block * block - block > 0, (cached, len(prompt), block)
    assert first.choices[0].text == second.choices[0].text


def test_structured_choice_through_vllms_guided_decoding(vllm_server):
    client = openai.OpenAI(base_url=vllm_server.openai_url, api_key="unused", max_retries=0, timeout=300)
    choices = ["lighthouse", "submarine", "volcano"]
    reply = client.completions.create(model="smollm2", prompt="My favourite word is", max_tokens=12, temperature=1.0,
                                      seed=3, n=2, extra_body={"structured_outputs": {"choice": choices}})
    assert sorted(c.index for c in reply.choices) == [0, 1]
    assert all(c.text in choices and c.finish_reason == "stop" for c in reply.choices), reply.choices


def test_logprobs_come_from_vllm_with_top_n_and_the_chosen_token(vllm_server):
    client = openai.OpenAI(base_url=vllm_server.openai_url, api_key="unused", max_retries=0, timeout=300)
    reply = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=5,
                                      temperature=0, logprobs=3)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for chosen, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(logprob, abs=1e-5)   # greedy: the best
        assert top[chosen] == pytest.approx(logprob, abs=1e-5)
