"""Disaggregated serving end to end: `splitserve serve` with separate prefill and decode workers.

One deployment per (transfer backend, workers) pair, started once per module on the
random-weight Llama checkpoint (chunked prefill: 256 tokens per step, so long prompts
cross chunk boundaries while their layers are being sent):

- greedy output through the disaggregated path equals the aggregated engine's and
  transformers' token for token (TCP and NIXL, 1P+1D and 2P+2D);
- conditional disaggregation: a short uncached part stays local, a long one goes to a
  prefill worker, a prompt the decode worker has cached stays local (worker counters);
- cancellation mid-prefill and mid-stream: both workers are idle within a second, and
  the prefill engine stopped computing the prompt.

Every test ends with a leak check on every worker: no KV block used, no transfer
reservation open, no finished prefill still holding blocks.
"""

from __future__ import annotations

import json
import socket
import time

import openai
import pytest

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.testing.models import random_prompt
from splitserve.testing.oracle import assert_greedy_match, hf_greedy
from splitserve.testing.waiting import wait_until
from splitserve.testing.workers import wait_idle, worker_stats

from .conftest import Server, start_serve, stop_serve

THRESHOLD = 32
MAX_TOKENS = 6
DEPLOYMENTS = [("nixl", 1, 1), ("tcp", 1, 1), ("tcp", 2, 2), ("nixl", 2, 2)]
DEFAULT = [DEPLOYMENTS[0]]        # what `splitserve serve` starts: NIXL, 1 prefill + 1 decode


# Lengths: a short one (local), one inside a block, several blocks, and one over two chunks.
PROMPTS = [random_prompt(1, 12), random_prompt(2, 45), random_prompt(3, 130), random_prompt(4, 300)]


def _id(d) -> str:
    return f"{d[0]}-{d[1]}P{d[2]}D"


@pytest.fixture(scope="module")
def deployment(request, llama_dir):
    backend, num_prefill, num_decode = request.param
    server = start_serve(str(llama_dir), "--transfer", backend, "--prefill-workers", str(num_prefill),
                         "--decode-workers", str(num_decode), "--remote-prefill-threshold", str(THRESHOLD),
                         "--max-num-batched-tokens", "256", "--prefill-timeout", "20",
                         # round-robin so that every worker of both pools serves (asserted below)
                         "--router", "round-robin",
                         num_workers=num_prefill + num_decode, aggregated=False)
    try:
        yield backend, server
    finally:
        stop_serve(server)


@pytest.fixture(scope="module")
def references(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=256, num_threads=1))
    aggregated = [r.token_ids for r in engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS,
                                                                               ignore_eos=True))]
    return aggregated, hf_greedy(llama_dir, PROMPTS, MAX_TOKENS, ignore_eos=True)


def _model(server: Server) -> str:
    return openai.OpenAI(base_url=server.openai_url, api_key="unused").models.list().data[0].id


def _complete(server: Server, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=60)
    out = client.completions.create(model=_model(server), prompt=prompt, max_tokens=max_tokens, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    return list(out.choices[0].token_ids)


def _stats(server: Server) -> dict:
    return {name: worker_stats(address) for name, address in server.workers.items()}


@pytest.mark.parametrize("deployment", DEPLOYMENTS, ids=_id, indirect=True)
def test_greedy_equals_aggregated_and_transformers(deployment, references):
    backend, server = deployment
    aggregated, hf = references
    before = _stats(server)
    for prompt, want, ref in zip(PROMPTS, aggregated, hf):
        got = _complete(server, prompt)
        assert got == want, (backend, len(prompt))
        assert_greedy_match(got, ref)
    after = wait_idle(server.workers, 1.0).stats
    decodes = [n for n in after if n.startswith("decode")]
    prefills = [n for n in after if n.startswith("prefill")]
    remote = sum(after[n].num_remote_prefills - before[n].num_remote_prefills for n in decodes)
    served = sum(after[n].num_prefills_served - before[n].num_prefills_served for n in prefills)
    assert remote == served == 3, after                 # every prompt but the 12-token one
    # Round-robin spreads the requests over every worker of both pools.
    assert all(after[n].num_requests > before[n].num_requests for n in decodes)
    assert all(after[n].num_prefills_served > before[n].num_prefills_served for n in prefills)
    assert all(after[n].num_prefill_fallbacks == 0 for n in decodes)


@pytest.mark.parametrize("deployment", DEFAULT, ids=_id, indirect=True)
def test_sampling_controls_through_the_prefill_worker_equal_aggregated(deployment, llama_dir):
    """The prefill worker samples the first token: logit_bias, min_tokens and the penalties must
    hold there too, so a 1P+1D request gives the aggregated engine's tokens exactly."""
    _, server = deployment
    [decode], [prefill] = server.role("decode"), server.role("prefill")
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=256, num_threads=1))
    client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=60)
    eos = min(engine.eos_token_ids)
    before = worker_stats(prefill).num_prefills_served
    # Fresh prompts, over the threshold: earlier tests' prompts are cached on the decode worker.
    for prompt in (random_prompt(40, 45), random_prompt(41, 130), random_prompt(42, 300)):
        [plain] = engine.generate([prompt], SamplingParams(max_tokens=1))
        controls = dict(logit_bias={plain.token_ids[0]: -100.0, eos: 100.0}, min_tokens=4,
                        repetition_penalty=0.6, frequency_penalty=0.5, presence_penalty=-1.0)
        [want] = engine.generate([prompt], SamplingParams(max_tokens=8, **controls))
        assert want.token_ids[0] != plain.token_ids[0] and want.token_ids[4:] == [eos]
        out = client.completions.create(
            model=_model(server), prompt=prompt, max_tokens=8, temperature=0,
            frequency_penalty=0.5, presence_penalty=-1.0,
            logit_bias={str(t): b for t, b in controls["logit_bias"].items()},
            extra_body={"return_token_ids": True, "min_tokens": 4, "repetition_penalty": 0.6})
        assert list(out.choices[0].token_ids) == want.token_ids, len(prompt)
    engine.close()
    assert worker_stats(prefill).num_prefills_served == before + 3      # every prompt went remote
    wait_idle(server.workers, 1.0)


@pytest.mark.parametrize("deployment", DEFAULT, ids=_id, indirect=True)
def test_prompt_logprobs_come_from_the_prefill_worker(deployment, llama_dir):
    """The prefill worker computes the prompt's logprobs and the decode worker sends them on
    with the first token: the aggregated engine's, also when the prompt was cached before."""
    _, server = deployment
    [prefill] = server.role("prefill")
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=256, num_threads=1))
    client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=60)
    prompt = random_prompt(60, THRESHOLD + 50)
    [want] = engine.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=1))
    engine.close()
    before = worker_stats(prefill).num_prefills_served
    for _ in range(2):              # the second time the prompt is cached on both workers
        out = client.completions.create(model=_model(server), prompt=prompt, max_tokens=2, temperature=0,
                                        echo=True, logprobs=1, extra_body={"prompt_logprobs": 1})
        choice = out.choices[0]
        got = choice.model_extra["prompt_logprobs"]
        assert len(got) == len(prompt) and got[0] is None
        assert [item[str(t)]["logprob"] for t, item in zip(prompt[1:], got[1:])] == pytest.approx(
            [e.logprob for e in want.prompt_logprobs], abs=1e-4)
        assert choice.logprobs.token_logprobs[1:len(prompt)] == pytest.approx(
            [e.logprob for e in want.prompt_logprobs], abs=1e-4)
    assert worker_stats(prefill).num_prefills_served >= before + 1
    wait_idle(server.workers, 1.0)


@pytest.mark.parametrize("deployment", DEFAULT, ids=_id, indirect=True)
def test_cache_salt_keeps_prefix_hits_and_routing_per_salt(deployment):
    """A prompt prefilled remotely under one salt is cached on the decode worker for that salt
    only: the same prompt under another salt is uncached there (remote prefill again, no
    cached tokens), under the first salt it is a local prefix hit."""
    _, server = deployment
    [decode], [prefill] = server.role("decode"), server.role("prefill")
    client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=60)
    prompt = random_prompt(50, THRESHOLD + 60)

    def run(salt: str):
        out = client.completions.create(model=_model(server), prompt=prompt, max_tokens=3, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True,
                                                    "cache_salt": salt})
        return list(out.choices[0].token_ids), out.usage.prompt_tokens_details.cached_tokens

    before, p_before = worker_stats(decode), worker_stats(prefill)
    first = run("tenant-a")
    d1 = worker_stats(decode)
    assert d1.num_remote_prefills == before.num_remote_prefills + 1 and first[1] == 0
    other = run("tenant-b")
    d2 = worker_stats(decode)
    assert d2.num_remote_prefills == d1.num_remote_prefills + 1          # uncached for this salt
    assert other == (first[0], 0)
    again = run("tenant-a")
    d3 = worker_stats(decode)
    assert d3.num_remote_prefills == d2.num_remote_prefills and d3.num_local_prefills == d2.num_local_prefills + 1
    assert again[0] == first[0] and again[1] == (len(prompt) // 16) * 16
    assert worker_stats(prefill).num_prefills_served == p_before.num_prefills_served + 2   # a and b
    wait_idle(server.workers, 1.0)


@pytest.mark.parametrize("deployment", DEFAULT, ids=_id, indirect=True)
def test_conditional_disaggregation_from_counters(deployment):
    _, server = deployment
    [decode], [prefill] = server.role("decode"), server.role("prefill")
    before_d, before_p = worker_stats(decode), worker_stats(prefill)
    short, long = random_prompt(10, THRESHOLD - 8), random_prompt(11, THRESHOLD + 40)
    _complete(server, short)
    d = worker_stats(decode)
    assert (d.num_local_prefills, d.num_remote_prefills) == (before_d.num_local_prefills + 1,
                                                            before_d.num_remote_prefills)
    first = _complete(server, long)
    d, p = worker_stats(decode), worker_stats(prefill)
    assert d.num_remote_prefills == before_d.num_remote_prefills + 1
    assert p.num_prefills_served == before_p.num_prefills_served + 1
    # The decode worker now caches the long prompt's full blocks: only 8 tokens are uncached.
    again = _complete(server, long)
    d2 = worker_stats(decode)
    assert again == first
    assert d2.num_local_prefills == d.num_local_prefills + 1 and d2.num_remote_prefills == d.num_remote_prefills
    wait_idle(server.workers, 1.0)


def _open_request(server: Server, prompt: list[int], max_tokens: int, stream: bool = True) -> socket.socket:
    """A raw HTTP request: closing the socket is a client disconnect, at any moment."""
    body = json.dumps({"model": _model(server), "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
                       "temperature": 0, "ignore_eos": True}).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


@pytest.mark.parametrize("deployment", DEFAULT, ids=_id, indirect=True)
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_cancel_mid_prefill_frees_both_workers(deployment, stream):
    _, server = deployment
    [prefill], [decode] = server.role("prefill"), server.role("decode")
    prompt = random_prompt(20 + stream, 3000)     # about a second of prefill in 256-token chunks
    before_p = worker_stats(prefill)
    sock = _open_request(server, prompt, 50, stream)
    wait_until(lambda: worker_stats(prefill).num_running == 1, timeout=10, interval=0.01, what="the prefill to start")
    d = worker_stats(decode)
    assert d.num_remote_prefill == 1 and d.num_transfer_reservations == 1
    # The reservation's blocks (3000 random tokens: no prefix hit) are what the decode worker holds.
    assert d.num_remote_prefill_kv_blocks == -(-3000 // 16) == d.num_used_kv_blocks
    sock.close()
    gone = time.monotonic()
    after = wait_idle(server.workers, 1.0, since=gone).stats        # fenced blocks included (num_used_kv_blocks)
    p = after["prefill-0"]
    assert p.num_aborted == before_p.num_aborted + 1
    assert p.num_prefills_served == before_p.num_prefills_served
    # The decode worker reused its granted blocks only once the prefill worker confirmed that
    # none of its writes was in flight any more.
    assert p.num_fences_served == before_p.num_fences_served + 1
    assert after["decode-0"].num_fences_confirmed == d.num_fences_confirmed + 1
    # The prefill engine stopped computing: the prompt was never finished. (Idle, read on the
    # engine thread between steps: nothing of the request runs any more.)
    assert p.num_prompt_tokens_computed - before_p.num_prompt_tokens_computed < len(prompt)


@pytest.mark.parametrize("deployment", DEFAULT, ids=_id, indirect=True)
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_cancel_mid_decode_frees_both_workers(deployment, stream):
    _, server = deployment
    [decode] = server.role("decode")
    before_d = worker_stats(decode)
    sock = _open_request(server, random_prompt(22 + stream, 200), 3000, stream)
    wait_until(lambda: worker_stats(decode).num_generated_tokens - before_d.num_generated_tokens >= 5,
               timeout=10, interval=0.01, what="the decode to start")
    if stream:
        received = b""
        while received.count(b"data:") < 5:
            received += sock.recv(65536)
    busy = worker_stats(decode)
    assert busy.num_running == 1 and busy.num_remote_prefills == before_d.num_remote_prefills + 1
    sock.close()
    gone = time.monotonic()
    after = wait_idle(server.workers, 1.0, since=gone).stats
    d = after["decode-0"]
    assert d.num_aborted == before_d.num_aborted + 1
    assert d.num_generated_tokens - before_d.num_generated_tokens < 3000


@pytest.mark.parametrize("deployment", DEFAULT, ids=_id, indirect=True)
def test_responses_api_over_the_disaggregated_path(deployment):
    """/v1/responses takes the chat route: a prompt past the threshold is prefilled remotely and
    the streamed response is the chat completion's greedy text."""
    _, server = deployment
    client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=60)
    instructions = "Answer in one short sentence, and name nothing but colours. " * 4
    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": "Name three colours."}]
    [prefill] = server.role("prefill")
    before = worker_stats(prefill).num_prefills_served
    with client.responses.stream(model=_model(server), instructions=instructions, input="Name three colours.",
                                 max_output_tokens=MAX_TOKENS, temperature=0) as stream:
        final = stream.get_final_response()
    assert worker_stats(prefill).num_prefills_served == before + 1
    chat = client.chat.completions.create(model=_model(server), messages=messages, max_tokens=MAX_TOKENS,
                                          temperature=0)
    assert final.output_text == chat.choices[0].message.content
    assert final.usage.input_tokens == chat.usage.prompt_tokens > THRESHOLD
    wait_idle(server.workers, 1.0)
