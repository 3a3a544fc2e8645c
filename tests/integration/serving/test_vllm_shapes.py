"""vLLM's response shapes and routes (issue 37), through both serving paths.

One `splitserve serve --max-logprobs -1` per path on the random-weight Llama checkpoint:
aggregated (one worker) and disaggregated (1 prefill + 1 decode over TCP, every prompt
longer than the threshold, so the prefill worker computes the prompt, its logprobs and
the first token). Each shape is read through the official openai client and as raw JSON
(httpx): fields vLLM always has are present (null where vLLM has null), completions'
top_logprobs lead with the chosen token, echo of token ids keeps the special tokens, chat's
role chunk carries the continuous usage, -1 logprobs give the whole vocabulary,
logprob_token_ids and truncation_side do what vLLM's do, a bad logit_bias id is named
(HTTP and gRPC), POST /invocations dispatches on the body's shape, and stop_reason names the stop
string or stop token that ended a choice (null for EOS and max_tokens).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from splitserve.testing.models import BASE_CONFIG
from splitserve.testing.openai_api import served_model_name

from .conftest import Server, start_serve, stop_serve

VOCAB = BASE_CONFIG["vocab_size"]
PROMPT_IDS = [1, 415, 2936, 9060, 285, 1142, 28705, 28740, 28734, 2421]     # starts with BOS (<s>)
CHAT = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
PATHS = ["aggregated", "disaggregated"]


@pytest.fixture(scope="module", params=PATHS)
def server(request, llama_dir):
    if request.param == "aggregated":
        srv = start_serve(str(llama_dir), "--max-logprobs", "-1")
    else:
        srv = start_serve(str(llama_dir), "--max-logprobs", "-1", "--transfer", "tcp", "--prefill-workers", "1",
                          "--decode-workers", "1", "--remote-prefill-threshold", "4", num_workers=2,
                          aggregated=False)
    try:
        yield srv
    finally:
        stop_serve(srv)


@pytest.fixture(scope="module")
def model(server: Server) -> str:
    return served_model_name(server.openai_url)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    from splitserve.checkpoints.model_source import open_checkpoint
    from splitserve.services.text.tokenizer import Tokenizer

    return Tokenizer(open_checkpoint(str(llama_dir)))


def post(server: Server, path: str, body: dict) -> dict:
    reply = httpx.post(f"{server.base_url}{path}", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def post_error(server: Server, path: str, body: dict) -> dict:
    reply = httpx.post(f"{server.base_url}{path}", json=body, timeout=120)
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]


def stream(server: Server, path: str, body: dict) -> list[dict]:
    """The chunks of a streamed response, as raw JSON objects."""
    chunks = []
    with httpx.stream("POST", f"{server.base_url}{path}", json={**body, "stream": True}, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def test_completion_top_logprobs_hold_the_chosen_token(server, client, model):
    body = {"model": model, "prompt": PROMPT_IDS, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for lp in (post(server, "/v1/completions", {**body, "logprobs": 0})["choices"][0]["logprobs"],
               client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=4, logprobs=0, **GREEDY
                                         ).choices[0].logprobs.model_dump()):
        assert [list(top) for top in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]
        assert [top[t] for top, t in zip(lp["top_logprobs"], lp["tokens"])] == lp["token_logprobs"]
    chunks = [c["choices"][0]["logprobs"] for c in stream(server, "/v1/completions", {**body, "logprobs": 0})
              if c["choices"] and c["choices"][0]["logprobs"]]
    assert [list(top) for lp in chunks for top in lp["top_logprobs"]] == [[t] for lp in chunks for t in lp["tokens"]]
    two = post(server, "/v1/completions", {**body, "logprobs": 2})["choices"][0]["logprobs"]
    assert all(t in top and 2 <= len(top) <= 3 for top, t in zip(two["top_logprobs"], two["tokens"]))
    # echo: the echoed prompt tokens' alternatives lead with the prompt token (vLLM's prompt logprob dicts).
    echo = post(server, "/v1/completions", {**body, "logprobs": 1, "echo": True, "return_tokens_as_token_ids": True})
    lp = echo["choices"][0]["logprobs"]
    assert lp["top_logprobs"][0] is None
    assert all(lp["tokens"][i] in lp["top_logprobs"][i] for i in range(1, len(PROMPT_IDS) + 4))


def test_echo_of_token_ids_is_the_prompts_whole_text(server, client, model, tokenizer):
    text = tokenizer.decode(PROMPT_IDS, skip_special_tokens=False)
    assert text.startswith("<s>")
    body = {"model": model, "prompt": PROMPT_IDS, "max_tokens": 3, "temperature": 0, "echo": True}
    plain = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=3, temperature=0).choices[0].text
    assert client.completions.create(**body).choices[0].text == text + plain
    assert post(server, "/v1/completions", body)["choices"][0]["text"] == text + plain
    assert "".join(c["choices"][0]["text"] for c in stream(server, "/v1/completions", body) if c["choices"]) \
        == text + plain
    # vLLM: with return_token_ids the prompt comes back as prompt_token_ids, not in the text.
    ids = post(server, "/v1/completions", {**body, "return_token_ids": True})["choices"][0]
    assert ids["text"] == plain and ids["prompt_token_ids"] == PROMPT_IDS


def test_chat_role_chunk_carries_the_continuous_usage(server, client, model):
    body = {"model": model, "messages": CHAT, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    raw = stream(server, "/v1/chat/completions", body)
    prompt_tokens = raw[-1]["usage"]["prompt_tokens"]
    assert raw[0]["choices"][0]["delta"]["role"] == "assistant"
    assert raw[0]["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}
    assert all(c["usage"] is not None for c in raw)
    chunks = list(client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=3, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert chunks[0].usage.prompt_tokens == prompt_tokens and chunks[0].usage.completion_tokens == 0
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 3


def test_fields_vllm_always_has_are_null_unless_asked_for(server, client, model):
    completion = {"model": model, "prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 0}
    choice = post(server, "/v1/completions", completion)["choices"][0]
    assert choice["prompt_logprobs"] is None and choice["prompt_token_ids"] is None and choice["token_ids"] is None
    asked = post(server, "/v1/completions",
                 {**completion, "return_token_ids": True, "prompt_logprobs": 1})["choices"][0]
    assert asked["prompt_token_ids"] == PROMPT_IDS and len(asked["token_ids"]) == 2
    assert asked["prompt_logprobs"][0] is None and len(asked["prompt_logprobs"]) == len(PROMPT_IDS)
    sdk = client.completions.create(**completion, extra_body={"return_token_ids": True}).choices[0]
    assert sdk.prompt_token_ids == PROMPT_IDS and sdk.prompt_logprobs is None
    first, *rest = [c["choices"][0] for c in stream(server, "/v1/completions", {**completion, "return_token_ids": True})
                    if c["choices"]]
    assert first["prompt_token_ids"] == PROMPT_IDS and all(c["prompt_token_ids"] is None for c in rest)
    assert all("token_ids" in c for c in [first, *rest])
    chat = {"model": model, "messages": CHAT, "max_tokens": 2, "temperature": 0}
    whole = post(server, "/v1/chat/completions", chat)
    assert whole["prompt_logprobs"] is None and whole["prompt_token_ids"] is None
    assert whole["choices"][0]["token_ids"] is None
    with_ids = client.chat.completions.create(**chat, extra_body={"return_token_ids": True})
    assert len(with_ids.prompt_token_ids) == whole["usage"]["prompt_tokens"]
    role, *more = stream(server, "/v1/chat/completions", {**chat, "return_token_ids": True})
    assert role["prompt_token_ids"] == with_ids.prompt_token_ids
    assert all(c["choices"][0]["token_ids"] is not None for c in more if c["choices"])
    assert stream(server, "/v1/chat/completions", chat)[0]["prompt_token_ids"] is None


def test_minus_one_logprobs_are_the_whole_vocabulary(server, client, model):
    body = {"model": model, "prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 0, "logprobs": -1,
            "return_tokens_as_token_ids": True}
    lp = post(server, "/v1/completions", body)["choices"][0]["logprobs"]
    assert [len(top) for top in lp["top_logprobs"]] == [VOCAB, VOCAB]
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=2, temperature=0, logprobs=True,
                                          top_logprobs=-1)
    assert [len(t.top_logprobs) for t in chat.choices[0].logprobs.content] == [VOCAB, VOCAB]
    prompt = post(server, "/v1/completions", {"model": model, "prompt": PROMPT_IDS[:4], "max_tokens": 1,
                                              "prompt_logprobs": -1})["choices"][0]["prompt_logprobs"]
    assert prompt[0] is None and [len(entry) for entry in prompt[1:]] == [VOCAB] * 3
    assert post_error(server, "/v1/completions", {**body, "logprobs": -2})["param"] == "logprobs"   # only -1
    # echo with logprobs -1: the echoed prompt tokens get the whole vocabulary too (prompt_logprobs 0 or not).
    echo = post(server, "/v1/completions", {"model": model, "prompt": PROMPT_IDS[:4], "max_tokens": 1, "echo": True,
                                            "logprobs": -1, "prompt_logprobs": 0, "return_tokens_as_token_ids": True})
    assert [len(top) for top in echo["choices"][0]["logprobs"]["top_logprobs"][1:]] == [VOCAB] * 4
    # One worker message carries a request's prompt logprobs: more than it can hold is a 400, not a broken stream.
    error = post_error(server, "/v1/completions", {"model": model, "prompt": PROMPT_IDS * 10, "max_tokens": 1,
                                                   "prompt_logprobs": -1})
    assert error["param"] == "prompt_logprobs" and "ask for fewer" in error["message"]


def test_logprob_token_ids_are_the_named_tokens_logprobs(server, client, model):
    named = [5, 7, 300]
    body = {"model": model, "prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 0, "logprobs": 0,
            "logprob_token_ids": named, "return_tokens_as_token_ids": True}
    lp = post(server, "/v1/completions", body)["choices"][0]["logprobs"]
    every = post(server, "/v1/completions", {**body, "logprobs": -1, "logprob_token_ids": None}
                 )["choices"][0]["logprobs"]["top_logprobs"]
    for top, token, whole in zip(lp["top_logprobs"], lp["tokens"], every):
        assert list(top) == [token] + [f"token_id:{t}" for t in named if f"token_id:{t}" != token]
        assert all(value == pytest.approx(whole[key], abs=1e-5) for key, value in top.items())
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=2, temperature=0, logprobs=True,
                                          extra_body={"logprob_token_ids": named, "return_tokens_as_token_ids": True})
    for t in chat.choices[0].logprobs.content:
        assert [x.token for x in t.top_logprobs][1:] == [f"token_id:{i}" for i in named]
    error = post_error(server, "/v1/completions", {**body, "logprobs": None})
    assert error["param"] == "logprob_token_ids" and "`logprobs` must be set" in error["message"]
    # The public gRPC API takes them too: each token's `top` is the named tokens', in their order.
    import grpc

    from splitserve.proto.v1 import inference_pb2, inference_pb2_grpc

    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        replies = list(stub.Generate(inference_pb2.GenerateRequest(
            token_ids=inference_pb2.TokenIds(ids=PROMPT_IDS), max_tokens=2, temperature=0, logprobs=0,
            logprob_token_ids=named), timeout=60))
        logprobs = [lp for r in replies for lp in r.logprobs]
        assert len(logprobs) == 2 and all([t.token_id for t in lp.top] == named for lp in logprobs)
        assert [t.logprob for t in logprobs[0].top] == pytest.approx(
            [every[0][f"token_id:{t}"] for t in named], abs=1e-5)


def test_truncation_side_keeps_the_first_or_last_tokens(server, client, model):
    def token_ids(prompt, **extra):
        return client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True, **extra}
                                         ).choices[0].token_ids
    assert token_ids(PROMPT_IDS, truncate_prompt_tokens=5, truncation_side="right") == token_ids(PROMPT_IDS[:5])
    assert token_ids(PROMPT_IDS, truncate_prompt_tokens=5, truncation_side="left") == token_ids(PROMPT_IDS[-5:])
    error = post_error(server, "/v1/completions", {"model": model, "prompt": "hi", "truncate_prompt_tokens": 1,
                                                   "truncation_side": "middle"})
    assert error["param"] == "truncation_side"


def test_a_logit_bias_id_outside_the_vocabulary_is_named(server, client, model):
    import grpc

    from splitserve.proto.v1 import common_pb2, inference_pb2, inference_pb2_grpc

    error = post_error(server, "/v1/completions", {"model": model, "prompt": "hi", "logit_bias": {"99999": 1}})
    assert "99999" in error["message"] and str(VOCAB) in error["message"]
    with pytest.raises(openai.BadRequestError, match="99999"):
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=2, logit_bias={"99999": 1})
    error = post_error(server, "/v1/completions", {"model": model, "prompt": "hi", "logit_bias": {"12x": 1}})
    assert error["param"] == "logit_bias" and "'12x'" in error["message"]
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(inference_pb2.GenerateRequest(
                text="hi", max_tokens=2, logit_bias=[common_pb2.TokenBias(token_id=99999, bias=1)]), timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "99999" in info.value.details()


def test_invocations_dispatches_on_the_body_shape(server, model):
    chat = post(server, "/invocations", {"model": model, "messages": CHAT, "max_tokens": 2})
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    text = post(server, "/invocations", {"model": model, "prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 0})
    assert text["object"] == "text_completion" and text["choices"][0]["text"]
    chunks = stream(server, "/invocations", {"model": model, "prompt": PROMPT_IDS, "max_tokens": 2})
    assert chunks and all(c["object"] == "text_completion" for c in chunks)
    error = post_error(server, "/invocations", {"model": model, "input": "embed me"})
    assert error["message"] == ("Cannot find suitable handler for request. Expected one of: "
                                "['ChatCompletionRequest', 'CompletionRequest']")
    # The official client posts to it too (a path beside /v1).
    sdk = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    out = sdk.post("/invocations", cast_to=openai.types.Completion,
                   body={"model": model, "prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 0})
    assert out.choices[0].text == text["choices"][0]["text"]
    with pytest.raises(openai.BadRequestError, match="Cannot find suitable handler"):
        sdk.post("/invocations", cast_to=openai.types.Completion, body={"model": model, "input": "x"})


def test_stop_reason_names_the_stop_string_or_token(server, client, model):
    body = {"model": model, "prompt": PROMPT_IDS, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    free = post(server, "/v1/completions", {**body, "return_token_ids": True})["choices"][0]
    assert free["finish_reason"] == "length" and "stop_reason" in free and free["stop_reason"] is None
    first_token = free["token_ids"][0]
    by_token = post(server, "/v1/completions", {**body, "stop_token_ids": [first_token]})["choices"][0]
    assert (by_token["finish_reason"], by_token["stop_reason"]) == ("stop", first_token)
    stop = next(ch for ch in free["text"] if not ch.isspace())
    by_string = post(server, "/v1/completions", {**body, "stop": [stop]})["choices"][0]
    assert (by_string["finish_reason"], by_string["stop_reason"]) == ("stop", stop)
    sdk = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=6, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert sdk.stop_reason == stop
    streamed = [c["choices"][0] for c in stream(server, "/v1/completions", {**body, "stop": [stop]}) if c["choices"]]
    assert all("stop_reason" in c for c in streamed)
    assert [c["stop_reason"] for c in streamed if c["finish_reason"]] == [stop]
    chat = {"model": model, "messages": CHAT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    chat_ids = post(server, "/v1/chat/completions", {**chat, "return_token_ids": True})["choices"][0]["token_ids"]
    whole = post(server, "/v1/chat/completions", {**chat, "stop_token_ids": [chat_ids[0]]})["choices"][0]
    assert (whole["finish_reason"], whole["stop_reason"]) == ("stop", chat_ids[0])
    chunks = [c["choices"][0] for c in stream(server, "/v1/chat/completions", {**chat, "stop_token_ids": [chat_ids[0]]})
              if c["choices"]]
    assert chunks[0]["stop_reason"] is None and chunks[-1]["stop_reason"] == chat_ids[0]
