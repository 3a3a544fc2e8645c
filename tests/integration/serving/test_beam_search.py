"""use_beam_search end to end: real `splitserve serve` deployments, the official openai client and
raw HTTP, against beam search computed here from the model itself.

The reference runs the checkpoint with transformers on CPU and does a straightforward beam
search over each step's full-vocabulary logprobs (vLLM's rules: 2 x n candidates per beam, EOS
finishes a beam, the length-penalised ranking). On a 4-token model a beam as wide as every
path must also return the brute-force best continuations, each scored over the whole
sequence. Deployments: a 4-token Llama aggregated and disaggregated (1 prefill + 1 decode,
every step prefilled remotely), and the usual 32000-token Llama aggregated (chat, streaming);
the public gRPC endpoint's beam_width on two of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
from pathlib import Path

import httpx
import openai
import pytest
import torch

from splitserve.testing.models import EOS_TOKEN_ID, build_random_model
from splitserve.testing.openai_api import served_model_name
from splitserve.testing.waiting import async_wait_until, wait_until
from splitserve.testing.workers import wait_idle, worker_stats

from .conftest import start_serve, stop_serve

TINY_VOCAB = 4                    # <unk>, <s>, </s> (EOS) and one byte token
TINY_PROMPT = [1, 3, 0, 3, 3, 0]
MARGIN = 1e-3                     # the reference's choices are this clear (no near-ties to break differently)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_random_model("llama", tmp_path_factory.mktemp("tiny-vocab"), seed=0, vocab_size=TINY_VOCAB,
                              num_hidden_layers=2)


DEPLOYMENTS = {"tiny-aggregated": ("tiny", ()),
               "tiny-disaggregated": ("tiny", ("--prefill-workers", "1", "--decode-workers", "1",
                                               "--remote-prefill-threshold", "1")),
               "llama-aggregated": ("llama", ())}


TINY = ["tiny-aggregated", "tiny-disaggregated"]


@pytest.fixture(scope="module")
def deployment(request, tiny_dir, llama_dir):
    """The deployment a test names (indirect parametrization); one server per deployment and module."""
    model, flags = DEPLOYMENTS[request.param]
    folder = tiny_dir if model == "tiny" else llama_dir
    aggregated = not flags
    server = start_serve(str(folder), *flags, num_workers=1 if aggregated else 2, aggregated=aggregated)
    try:
        yield model, folder, server
    finally:
        stop_serve(server)


@functools.cache
def hf_model(folder: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def next_logprobs(folder: Path, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_model(folder)(torch.tensor([token_ids])).logits[0, -1]
    return torch.log_softmax(logits.double(), dim=-1)


def score(prompt: list[int], tokens: list[int], cum: float, length_penalty: float) -> float:
    seq = prompt + tokens
    return cum / ((len(seq) - (seq[-1] == EOS_TOKEN_ID)) ** length_penalty)


def reference_beam_search(folder: Path, prompt: list[int], width: int, max_tokens: int,
                          length_penalty: float = 1.0) -> list[tuple[list[int], float, str]]:
    """(tokens with a final EOS, cumulative logprob, finish reason) of the `width` best beams."""
    live: list[tuple[list[int], float]] = [([], 0.0)]
    done: list[tuple[list[int], float, str]] = []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in live:
            lps = next_logprobs(folder, prompt + tokens)
            values, ids = lps.topk(min(2 * width, lps.numel()))
            for token, lp in zip(ids.tolist(), values.tolist()):
                if token == EOS_TOKEN_ID:
                    done.append((tokens + [token], cum + lp, "stop"))
                else:
                    candidates.append((tokens + [token], cum + lp))
        candidates.sort(key=lambda c: -c[1])
        assert_clear([c[1] for c in candidates], width, "the beams kept at a step")
        live = candidates[:width]
        if not live:
            break
    ranked = sorted(done + [(t, c, "length") for t, c in live], key=lambda b: -score(prompt, b[0], b[1],
                                                                                     length_penalty))
    assert_clear([score(prompt, t, c, length_penalty) for t, c, _ in ranked], width, "the final ranking")
    return ranked[:width]


def assert_clear(sorted_scores: list[float], width: int, what: str) -> None:
    """The test's prompt must not leave a near-tie where the reference draws a line."""
    scores = sorted_scores[:width + 1]
    gaps = [a - b for a, b in itertools.pairwise(scores)]
    assert all(g > MARGIN for g in gaps), f"{what} holds a near-tie ({gaps}); choose another prompt"


def beams_of(choices) -> list[tuple[list[int], float, str]]:
    """(token ids, sum of their logprobs, finish reason) of each completions choice, in index order."""
    return [(c.token_ids, sum(c.logprobs.token_logprobs), c.finish_reason)
            for c in sorted(choices, key=lambda c: c.index)]


def assert_beams_equal(got, want) -> None:
    assert [(t, r) for t, _, r in got] == [(t, r) for t, _, r in want]
    assert [c for _, c, _ in got] == pytest.approx([c for _, c, _ in want], abs=1e-4)


def prompt_of(model: str) -> list[int]:
    return TINY_PROMPT if model == "tiny" else [1, 415, 2936, 9060, 285, 1142, 28705]


@pytest.mark.parametrize("deployment", list(DEPLOYMENTS), indirect=True)
@pytest.mark.parametrize("width, max_tokens, length_penalty", [(3, 5, 1.0), (2, 4, 0.5)])
def test_completions_beams_equal_a_reference_beam_search(deployment, width, max_tokens, length_penalty):
    model, folder, server = deployment
    client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=120)
    before = {a: worker_stats(a) for a in server.role("decode")}
    prompt = prompt_of(model)
    out = client.completions.create(
        model=served_model_name(server.openai_url), prompt=prompt, max_tokens=max_tokens, n=width, logprobs=0,
        extra_body={"use_beam_search": True, "length_penalty": length_penalty, "return_token_ids": True,
                    "include_stop_str_in_output": True})
    want = reference_beam_search(folder, prompt, width, max_tokens, length_penalty)
    assert_beams_equal(beams_of(out.choices), want)
    assert out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens == sum(len(t) for t, _, _ in want)
    if server.role("decode"):           # disaggregated: the steps' prompts were prefilled remotely
        remote = sum(worker_stats(a).num_remote_prefills - before[a].num_remote_prefills for a in before)
        assert remote >= max_tokens, remote
    wait_idle(server.workers, 10.0)


@pytest.mark.parametrize("deployment", TINY, indirect=True)
def test_a_beam_as_wide_as_every_path_returns_the_brute_force_best(deployment):
    _, folder, server = deployment
    width, max_tokens = 9, 2      # 3 non-EOS tokens: at most 9 live candidates per step, all kept
    non_eos = [t for t in range(TINY_VOCAB) if t != EOS_TOKEN_ID]
    paths = [[EOS_TOKEN_ID]] + [[a, b] for a, b in itertools.product(non_eos, range(TINY_VOCAB))]

    def cumulative(tokens: list[int]) -> float:
        with torch.inference_mode():
            logits = hf_model(folder)(torch.tensor([TINY_PROMPT + tokens])).logits[0]
        lps = torch.log_softmax(logits.double(), dim=-1)
        return sum(float(lps[len(TINY_PROMPT) - 1 + i, t]) for i, t in enumerate(tokens))

    scored = sorted(((p, cumulative(p)) for p in paths), key=lambda pc: -score(TINY_PROMPT, pc[0], pc[1], 1.0))
    want = [(p, c, "stop" if p[-1] == EOS_TOKEN_ID else "length") for p, c in scored[:width]]
    body = {"model": served_model_name(server.openai_url), "prompt": TINY_PROMPT, "max_tokens": max_tokens,
            "n": width, "logprobs": 0, "use_beam_search": True, "return_token_ids": True}
    with httpx.Client(timeout=120) as http:
        kept = http.post(f"{server.openai_url}/completions", json={**body, "include_stop_str_in_output": True})
        cut = http.post(f"{server.openai_url}/completions", json=body)
    assert kept.status_code == 200, kept.text
    got = [(c["token_ids"], sum(c["logprobs"]["token_logprobs"]), c["finish_reason"])
           for c in kept.json()["choices"]]
    assert [c["index"] for c in kept.json()["choices"]] == list(range(width))
    assert_beams_equal(got, want)
    # Without include_stop_str_in_output the EOS leaves the tokens and logprobs, not the ranking.
    assert [(c["token_ids"], c["finish_reason"]) for c in cut.json()["choices"]] == \
        [(t[:-1] if r == "stop" else t, r) for t, _, r in want]


@pytest.mark.parametrize("deployment", ["llama-aggregated"], indirect=True)    # chat: the 32000-token model
def test_chat_beam_search_whole_and_streamed_as_vllm_streams_it(deployment):
    _, folder, server = deployment
    from splitserve.checkpoints.model_source import open_checkpoint
    from splitserve.services.text.tokenizer import Tokenizer

    messages = [{"role": "user", "content": "Name three colours."}]
    name = served_model_name(server.openai_url)
    client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=120)
    whole = client.chat.completions.create(model=name, messages=messages, n=3, max_tokens=4, logprobs=True,
                                           top_logprobs=2, extra_body={"use_beam_search": True,
                                                                       "return_token_ids": True,
                                                                       "include_stop_str_in_output": True})
    prompt = Tokenizer(open_checkpoint(str(folder))).apply_chat_template(messages)
    got = [(c.token_ids, sum(t.logprob for t in c.logprobs.content), c.finish_reason) for c in whole.choices]
    assert_beams_equal(got, reference_beam_search(folder, prompt, 3, 4))
    assert all(len(t.top_logprobs) == 2 for c in whole.choices for t in c.logprobs.content)

    body = {"model": name, "messages": messages, "n": 3, "max_tokens": 4, "use_beam_search": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{server.openai_url}/chat/completions",
                                                        json=body) as reply:
        assert reply.status_code == 200
        events = [line[len("data: "):] for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    roles = [c["choices"][0] for c in chunks[:3]]
    assert [(r["index"], r["delta"]["role"]) for r in roles] == [(i, "assistant") for i in range(3)]
    replies = [c["choices"][0] for c in chunks[3:6]]
    assert [r["index"] for r in replies] == [0, 1, 2]
    assert [r["delta"]["content"] for r in replies] == [c.message.content for c in whole.choices]
    assert [r["finish_reason"] for r in replies] == [c.finish_reason for c in whole.choices]
    assert chunks[6]["choices"] == [] and chunks[6]["usage"]["completion_tokens"] == whole.usage.completion_tokens
    assert len(chunks) == 7


@pytest.mark.parametrize("deployment", ["llama-aggregated"], indirect=True)
def test_what_beam_search_cannot_do_is_a_400_naming_it(deployment):
    _, _, server = deployment
    name = served_model_name(server.openai_url)
    cases = [({"stream": True}, "stream", "Streaming is not currently supported with beam search"),
             ({"stop": ["x"]}, "stop", "beam search"), ({"n": 11}, "n", "at most 10"),
             ({"temperature": 0.8, "top_p": 0.5}, "top_p", "beam search")]
    with httpx.Client(timeout=60) as http:
        for fields, param, words in cases:
            reply = http.post(f"{server.openai_url}/completions", json={
                "model": name, "prompt": "hi", "max_tokens": 2, "use_beam_search": True, **fields})
            assert reply.status_code == 400, (fields, reply.text)
            error = reply.json()["error"]
            assert error["param"] == param and words in error["message"], error
        ok = http.post(f"{server.openai_url}/completions", json={
            "model": name, "prompt": "hi", "max_tokens": 2, "use_beam_search": True, "temperature": 0.8, "n": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


@pytest.mark.parametrize("deployment", ["tiny-disaggregated", "llama-aggregated"], indirect=True)
def test_public_grpc_beam_width_answers_one_message_per_beam(deployment):
    import grpc

    from splitserve.proto.v1 import common_pb2, inference_pb2, inference_pb2_grpc

    model, folder, server = deployment
    prompt = prompt_of(model)
    request = inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=prompt), max_tokens=4,
                                            beam_width=3, length_penalty=0.5, logprobs=0, include_usage=True,
                                            include_stop_str_in_output=True)
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        replies = list(stub.Generate(request, timeout=120))
        quiet = list(stub.Generate(inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=prompt),
                                                                 max_tokens=2, beam_width=2), timeout=120))
        refusals = []
        for bad in (inference_pb2.GenerateRequest(text="hi", beam_width=2, stop=["x"]),
                    inference_pb2.GenerateRequest(text="hi", beam_width=11),
                    inference_pb2.GenerateRequest(text="hi", length_penalty=0.5)):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(bad, timeout=30))
            refusals.append(info.value.code())
    want = reference_beam_search(folder, prompt, 3, 4, 0.5)
    names = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}
    got = [(list(r.token_ids), sum(lp.logprob for lp in r.logprobs), names[r.finish_reason]) for r in replies]
    assert [r.index for r in replies] == [0, 1, 2]
    assert_beams_equal(got, want)
    assert [r.HasField("usage") for r in replies] == [False, False, True]
    assert replies[-1].usage.completion_tokens == sum(len(t) for t, _, _ in want)
    assert replies[-1].usage.prompt_tokens == len(prompt)
    assert refusals == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert [r.index for r in quiet] == [0, 1] and all(r.token_ids and not r.logprobs for r in quiet)


@pytest.mark.parametrize("deployment", ["tiny-disaggregated"], indirect=True)
def test_a_client_that_leaves_mid_search_stops_it_and_leaves_the_workers_idle(deployment):
    _, _, server = deployment
    body = {"model": served_model_name(server.openai_url), "prompt": TINY_PROMPT, "max_tokens": 2000, "n": 4,
            "use_beam_search": True, "ignore_eos": True}
    decode = server.role("decode")[0]
    before = worker_stats(decode).num_remote_prefills

    async def leave_mid_search() -> None:
        async with httpx.AsyncClient(timeout=300) as http:
            request = asyncio.ensure_future(http.post(f"{server.openai_url}/completions", json=body))
            # Several steps ran (each a remote prefill here), the search goes on: the client leaves.
            await async_wait_until(lambda: worker_stats(decode).num_remote_prefills >= before + 8, timeout=60,
                                   interval=0.05, what="a few beam search steps")
            assert not request.done()
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request

    asyncio.run(leave_mid_search())
    wait_idle(server.workers, 10.0)
    wait_until(lambda: in_flight(server) == 0, timeout=10, what="the frontend to serve no request")
    steps = worker_stats(decode).num_remote_prefills
    assert steps < before + 200, steps            # far from 2000 steps x 4 beams: the search stopped


def in_flight(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("splitserve_requests_in_flight"))
