"""The official `openai` client (and raw HTTP) against a real `splitserve serve --aggregated`.

One server per module on the random-weight Llama checkpoint: greedy output
equals the engine's and transformers' token for token, usage figures are
right, sampling parameters and logprobs do what they say, /metrics counts what
happened, every bad input gets its 4xx and the server keeps serving, and a client
that goes away mid-request (HTTP or the public gRPC call) leaves the worker's KV
pool idle within a second.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.text.generate import generate_text
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.testing.oracle import assert_greedy_match, hf_greedy
from splitserve.testing.workers import wait_idle, worker_stats

MODEL = "llama"          # the served name is the checkpoint folder's name, read from /v1/models
PROMPT_IDS = [1, 415, 2936, 9060, 285, 1142, 28705, 28740, 28734, 2421]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
GREEDY = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def server(llama_server):
    return llama_server


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=128, num_threads=1))


def test_health_ready_and_models(server, model_name, llama_dir):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/ready").status_code == 200
    assert model_name == llama_dir.name


def test_greedy_completion_equals_engine_and_transformers(client, model_name, engine, llama_dir):
    out = client.completions.create(model=model_name, prompt=PROMPT_IDS, max_tokens=12, temperature=0,
                                    extra_body=GREEDY)
    choice = out.choices[0]
    [want] = generate_text(engine, [PROMPT_IDS], SamplingParams(max_tokens=12, ignore_eos=True))
    assert choice.token_ids == want.token_ids
    assert choice.text == want.text
    assert choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (10, 12, 22)
    [ref] = hf_greedy(llama_dir, [PROMPT_IDS], 12, ignore_eos=True)
    assert_greedy_match(choice.token_ids, ref)


def test_text_prompt_streaming_equals_whole(client, model_name, engine):
    kwargs = dict(model=model_name, prompt="The quick brown fox", max_tokens=10, temperature=0,
                  extra_body=GREEDY)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    [want] = engine.generate(["The quick brown fox"], SamplingParams(max_tokens=10, ignore_eos=True))
    assert whole.choices[0].token_ids == want.token_ids
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == 10
    assert usage.prompt_tokens == whole.usage.prompt_tokens == len(engine.tokenizer.encode("The quick brown fox"))


def test_chat_whole_and_streamed(client, model_name, engine):
    prompt_ids = engine.tokenizer.apply_chat_template(CHAT)
    [want] = generate_text(engine, [prompt_ids], SamplingParams(max_tokens=9, ignore_eos=True))
    whole = client.chat.completions.create(model=model_name, messages=CHAT, max_completion_tokens=9,
                                           temperature=0, extra_body=GREEDY)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want.text
    assert whole.choices[0].token_ids == want.token_ids
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt_ids), 9)
    stream = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=9, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == want.text
    assert chunks[-1].usage.total_tokens == len(prompt_ids) + 9
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string_cuts_the_text(client, model_name, engine):
    [free] = generate_text(engine, [PROMPT_IDS], SamplingParams(max_tokens=16, ignore_eos=True))
    stop = free.text[len(free.text) // 2:][:3]
    assert stop.strip(), free.text
    expected = free.text[:free.text.index(stop)]
    for stream in (False, True):
        out = client.completions.create(model=model_name, prompt=PROMPT_IDS, max_tokens=16, temperature=0,
                                        stop=[stop], stream=stream, extra_body={"ignore_eos": True})
        if stream:
            chunks = [c for c in out if c.choices]
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, reason = out.choices[0].text, out.choices[0].finish_reason
        assert (text, reason) == (expected, "stop")


def test_a_stop_string_ends_the_request_on_the_worker(server, client, model_name, engine):
    """Workers never see stop strings: the frontend finds one and closes the worker stream,
    which aborts the request there long before its token budget is spent."""
    [free] = generate_text(engine, [PROMPT_IDS], SamplingParams(max_tokens=16, ignore_eos=True))
    stop = free.text[len(free.text) // 2:][:3]
    [worker] = server.worker_addresses
    before = worker_stats(worker)
    out = client.completions.create(model=model_name, prompt=PROMPT_IDS, max_tokens=LONG["max_tokens"],
                                    temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert (out.choices[0].text, out.choices[0].finish_reason) == (free.text[:free.text.index(stop)], "stop")
    stats = wait_idle({"worker": worker}, 1.0, since=time.monotonic()).stats["worker"]
    assert stats.num_aborted == before.num_aborted + 1, stats
    assert stats.num_generated_tokens - before.num_generated_tokens < LONG["max_tokens"] // 2


def test_logprobs_and_seeded_sampling(client, model_name):
    out = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)   # greedy = top-1
    runs = [client.completions.create(model=model_name, prompt="Once upon", max_tokens=8, temperature=1.0,
                                      top_p=0.9, seed=1234, extra_body={"ignore_eos": True}).choices[0].text
            for _ in range(2)]
    assert runs[0] == runs[1]
    other = client.completions.create(model=model_name, prompt="Once upon", max_tokens=8, temperature=1.0,
                                      top_p=0.9, seed=4321, extra_body={"ignore_eos": True}).choices[0].text
    assert other != runs[0]           # the seed is what made the two runs agree
    greedy = client.completions.create(model=model_name, prompt="Once upon", max_tokens=8, temperature=0,
                                       extra_body=GREEDY).choices[0]
    nucleus = client.completions.create(model=model_name, prompt="Once upon", max_tokens=8, temperature=1.0,
                                        top_p=1e-6, seed=99, extra_body=GREEDY).choices[0]
    assert nucleus.token_ids == greedy.token_ids     # a tiny top_p keeps only the most likely token


def test_completion_logprobs_whole_and_streamed(client, model_name):
    kwargs = dict(model=model_name, prompt=PROMPT_IDS, max_tokens=5, temperature=0, logprobs=2,
                  extra_body=GREEDY)
    whole = client.completions.create(**kwargs)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == whole.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(chosen)       # greedy = top-1
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    assert all(x <= 0 for x in lp.token_logprobs)
    chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs and c.choices[0].logprobs.tokens]
    assert [t for x in streamed for t in x.tokens] == lp.tokens
    assert [v for x in streamed for v in x.token_logprobs] == pytest.approx(lp.token_logprobs)
    assert [o for x in streamed for o in x.text_offset] == lp.text_offset


LONG = {"ignore_eos": True, "max_tokens": 3000}
BAD_BODIES = [
    # (raw body or JSON object, endpoint, status, param)
    (b"{not json", "completions", 400, None),
    (b"[1, 2]", "completions", 400, None),
    (b"\xff\xfe", "completions", 400, None),
    ({"prompt": "hi"}, "completions", 400, "model"),
    ({"model": "MODEL", "prompt": "hi", "max_tokens": "5"}, "completions", 400, "max_tokens"),
    ({"model": "MODEL", "prompt": "hi", "temperature": "hot"}, "completions", 400, "temperature"),
    ({"model": "MODEL", "prompt": "hi", "stream": "yes"}, "completions", 400, "stream"),
    ({"model": "MODEL", "messages": "hi"}, "chat/completions", 400, "messages"),
    ({"model": "MODEL", "messages": []}, "chat/completions", 400, "messages"),
    ({"model": "MODEL", "messages": [{"role": "tool", "content": "x"}]}, "chat/completions", 400,
     "messages.0.tool_call_id"),
    ({"model": "other-model", "prompt": "hi"}, "completions", 404, "model"),
    ({"model": "MODEL", "prompt": [5] * 5000}, "completions", 400, "prompt"),
    ({"model": "MODEL", "prompt": "hi", "max_tokens": 0}, "completions", 400, "max_tokens"),
    ({"model": "MODEL", "prompt": "hi", "max_tokens": -3}, "completions", 400, "max_tokens"),
    ({"model": "MODEL", "prompt": "hi", "max_tokens": 10**6}, "completions", 400, "max_tokens"),
    ({"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**6},
     "chat/completions", 400, "max_completion_tokens"),
    ({"model": "MODEL", "prompt": "hi", "n": 0}, "completions", 400, "n"),
    ({"model": "MODEL", "prompt": "hi", "n": 17}, "completions", 400, "n"),
    ({"model": "MODEL", "prompt": "hi", "n": 3, "best_of": 2}, "completions", 400, "best_of"),
    ({"model": "MODEL", "prompt": "hi", "best_of": 3, "stream": True}, "completions", 400, "best_of"),
    ({"model": "MODEL", "prompt": "hi", "stream": True, "prompt_logprobs": 1}, "completions", 400, "prompt_logprobs"),
    ({"model": "MODEL", "prompt": "hi", "allowed_token_ids": []}, "completions", 400, "allowed_token_ids"),
    ({"model": "MODEL", "prompt": "hi", "prompt_logprobs": 21}, "completions", 400, "prompt_logprobs"),
    ({"model": "MODEL", "prompt": "hi", "presence_penalty": 2.5}, "completions", 400, "presence_penalty"),
    ({"model": "MODEL", "prompt": "hi", "logit_bias": {"x": 1.0}}, "completions", 400, "logit_bias"),
    ({"model": "MODEL", "prompt": "hi", "logit_bias": {"99999999": 1.0}}, "completions", 400, None),
    ({"model": "MODEL", "prompt": "hi", "max_tokens": 2, "min_tokens": 3}, "completions", 400, None),
    ({"model": "MODEL", "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "chat/completions", 400, "tool_choice"),
    ({"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, "chat/completions",
     400, "frobnicate"),
    ({"model": "MODEL", "prompt": "hi", "temperature": 5}, "completions", 400, "temperature"),
    ({"model": "MODEL", "prompt": "hi", "top_p": 0}, "completions", 400, "top_p"),
    ({"model": "MODEL", "prompt": "hi", "logprobs": 50}, "completions", 400, "logprobs"),
    ({"model": "MODEL", "prompt": "hi", "logprobs": 0, "logprob_token_ids": [99999]}, "completions", 400, None),
    ({"model": "MODEL", "prompt": "hi", "stop": ""}, "completions", 400, "stop"),
    ({"model": "MODEL", "prompt": "hi", "seed": 2**70}, "completions", 400, "seed"),
    ({"model": "MODEL", "prompt": ""}, "completions", 400, "prompt"),
    ({"model": "MODEL", "prompt": "hi", "stream_options": {"include_usage": True}}, "completions", 400,
     "stream_options"),
    ({"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "chat/completions", 400, "top_logprobs"),
    ({"model": "MODEL", "prompt": []}, "completions", 400, "prompt"),
    ({"model": "MODEL", "prompt": ["hi"] * 65}, "completions", 400, "prompt"),
    ({"model": "MODEL", "prompt": [[1, 2], [3, 99999999]]}, "completions", 400, None),   # the worker refuses one
    ({"model": "MODEL", "prompt": [1, 2**40]}, "completions", 400, "prompt"),
    ({"model": "MODEL", "prompt": "hi", "top_k": 2**40}, "completions", 400, "top_k"),
    (b'{"model": "MODEL", "prompt": "hi", "temperature": NaN}', "completions", 400, "temperature"),
    ({"model": "MODEL", "messages": [{"role": "user", "content": 7}]}, "chat/completions", 400, "messages.0.content"),
    # Refused by the worker (token id outside the vocabulary), streamed or not: still a 400.
    ({"model": "MODEL", "prompt": [1, 99999999]}, "completions", 400, None),
    ({"model": "MODEL", "prompt": [1, 99999999], "stream": True}, "completions", 400, None),
]


@pytest.mark.parametrize("body, endpoint, status, param", BAD_BODIES)
def test_bad_input_gets_its_4xx(server, model_name, body, endpoint, status, param):
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    body = body.replace(b'"MODEL"', json.dumps(model_name).encode())
    reply = httpx.post(f"{server.openai_url}/{endpoint}", content=body,
                       headers={"Content-Type": "application/json"}, timeout=30)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error


USER = [{"role": "user", "content": "x"}]
LOGPROB_REFUSALS = [
    # -1 (vLLM's whole vocabulary) is more than the default --max-logprobs of 20 allows: vLLM's 400 and words.
    ({"prompt": "hi", "logprobs": -1}, "completions", "logprobs",
     "Requested sample logprobs of 32000, which is greater than max allowed: 20"),
    ({"messages": USER, "logprobs": True, "top_logprobs": -1}, "chat/completions", "top_logprobs",
     "Requested sample logprobs of 32000, which is greater than max allowed: 20"),
    ({"prompt": "hi", "prompt_logprobs": -1}, "completions", "prompt_logprobs",
     "Requested prompt logprobs of 32000, which is greater than max allowed: 20"),
    ({"prompt": "hi", "logprobs": 0, "logprob_token_ids": list(range(21))}, "completions", "logprob_token_ids",
     "Requested logprob_token_ids of length 21, which is greater than max allowed: 20"),
    ({"messages": USER, "logprob_token_ids": [3]}, "chat/completions", "logprob_token_ids",
     "when using `logprob_token_ids`, `logprobs` must be set to true."),
]


@pytest.mark.parametrize("body, endpoint, param, message", LOGPROB_REFUSALS)
def test_logprob_counts_past_max_logprobs_are_refused_in_vllms_words(server, model_name, body, endpoint, param,
                                                                      message):
    reply = httpx.post(f"{server.openai_url}/{endpoint}", json={"model": model_name, **body}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"] == message, error


def test_server_keeps_serving_after_bad_input(server, client, model_name):
    for path, method, status in (("/nope", "GET", 404), ("/v1/completions", "GET", 405),
                                 ("/v1/chat/completions", "PUT", 405)):
        reply = httpx.request(method, f"{server.base_url}{path}")
        assert reply.status_code == status and reply.json()["error"]["message"], reply.text
        if status == 405:
            assert reply.headers["allow"] == "POST"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_name, prompt="hi", max_tokens=0)
    out = client.completions.create(model=model_name, prompt="still there?", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1


def test_disconnect_mid_stream_frees_the_worker(server, model_name):
    [worker] = server.worker_addresses
    aborted_before = worker_stats(worker).num_aborted
    body = {"model": model_name, "messages": CHAT, "stream": True, "temperature": 0, **LONG}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.openai_url}/chat/completions", json=body) as reply:
            assert reply.status_code == 200
            lines = reply.iter_lines()
            received = [line for _, line in zip(range(6), lines) if line.startswith("data:")]
            assert received
            busy = worker_stats(worker)
            assert busy.num_running == 1 and busy.num_used_kv_blocks > 0
        gone = time.monotonic()
    stats = wait_idle({"worker": worker}, 1.0, since=gone).stats["worker"]
    assert stats.num_aborted == aborted_before + 1, stats
    assert stats.num_generated_tokens < 3000


def test_disconnect_while_waiting_for_a_whole_response(server, model_name):
    [worker] = server.worker_addresses
    aborted_before = worker_stats(worker).num_aborted
    body = {"model": model_name, "prompt": PROMPT_IDS, **LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.openai_url}/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    gone = time.monotonic()
    stats = wait_idle({"worker": worker}, 1.0, since=gone).stats["worker"]
    assert stats.num_aborted == aborted_before + 1, stats


def _scrape(base_url: str) -> dict[tuple, float]:
    text = httpx.get(f"{base_url}/metrics").text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_metrics(server, model_name):
    before = _scrape(server.base_url)
    body = {"model": model_name, "prompt": PROMPT_IDS, "max_tokens": 300, "stream": True, "temperature": 0,
            **GREEDY}           # long enough to be in flight while /metrics is read
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.openai_url}/completions", json=body) as reply:
            lines = reply.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            during = _scrape(server.base_url)
            rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    after = _scrape(server.base_url)

    def grew(name: str, labels: tuple = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert during[("splitserve_requests_in_flight", ())] == 1
    assert after[("splitserve_requests_in_flight", ())] == 0
    # Admission counts (the planner's arrivals and prompt mix) are there while the request runs.
    admitted = ("splitserve_admitted_requests_total", ())
    assert during[admitted] - before.get(admitted, 0.0) == 1 and grew(admitted[0]) == 1
    assert grew("splitserve_admitted_prompt_tokens_total") == len(PROMPT_IDS)
    # The cap it asked for: the planner's output-length prior until requests end.
    assert grew("splitserve_admitted_capped_requests_total") == 1
    assert grew("splitserve_admitted_max_tokens_total") == 300
    assert grew("splitserve_time_to_first_token_seconds_count") == 1
    assert grew("splitserve_e2e_request_latency_seconds_count") == 1
    assert 1 <= grew("splitserve_inter_token_latency_seconds_count") <= 299     # a gap per later delta
    assert grew("splitserve_prompt_tokens_total") == len(PROMPT_IDS)
    assert grew("splitserve_generation_tokens_total") == 300
    assert grew("splitserve_requests_total", (("api", "completions"), ("status", "ok"))) == 1
    refused = httpx.post(f"{server.openai_url}/completions",
                         json={"model": model_name, "prompt": "hi", "max_tokens": -1})
    assert refused.status_code == 400
    invalid = ("splitserve_requests_total", (("api", "completions"), ("status", "invalid")))
    assert _scrape(server.base_url).get(invalid, 0.0) - before.get(invalid, 0.0) == 1
    # A chat without max_tokens may run to the end of the context, which says nothing of its
    # length: admitted, but not a cap the prior counts.
    chat = httpx.post(f"{server.openai_url}/chat/completions", timeout=60,
                      json={"model": model_name, "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                            "allowed_token_ids": [415], "stop_token_ids": [415]})    # one token, then stop
    assert chat.status_code == 200, chat.text
    last = _scrape(server.base_url)
    assert last[admitted] - after[admitted] == 1
    assert last[("splitserve_admitted_capped_requests_total", ())] == after[("splitserve_admitted_capped_requests_total", ())]


def test_public_grpc_generate(server, model_name, engine):
    import grpc

    from splitserve.proto.v1 import common_pb2, inference_pb2, inference_pb2_grpc

    [want] = generate_text(engine, [PROMPT_IDS], SamplingParams(max_tokens=7, ignore_eos=True))
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=PROMPT_IDS), max_tokens=7,
                                                temperature=0, ignore_eos=True, include_usage=True)
        replies = list(stub.Generate(request, timeout=60))
        assert [t for r in replies for t in r.token_ids] == want.token_ids
        assert "".join(r.text for r in replies) == want.text
        assert replies[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert replies[-1].usage.completion_tokens == 7 and replies[-1].usage.prompt_tokens == 10
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(inference_pb2.GenerateRequest(model="nope", text="hi"), timeout=10))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(inference_pb2.GenerateRequest(text="hi", max_tokens=10**6), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_public_grpc_chat_stop_and_logprobs(server, model_name, engine):
    import grpc

    from splitserve.proto.v1 import common_pb2, inference_pb2, inference_pb2_grpc

    prompt_ids = engine.tokenizer.apply_chat_template(CHAT)
    [free] = generate_text(engine, [prompt_ids], SamplingParams(max_tokens=16, ignore_eos=True))
    stop = free.text[len(free.text) // 2:][:3]
    assert stop.strip(), free.text
    chat = inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(**m) for m in CHAT])
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        replies = list(stub.Generate(inference_pb2.GenerateRequest(
            chat=chat, max_tokens=16, temperature=0, ignore_eos=True, stop=[stop], logprobs=2,
            include_usage=True), timeout=60))
        assert "".join(r.text for r in replies) == free.text[:free.text.index(stop)]
        assert replies[-1].finish_reason == common_pb2.FINISH_REASON_STOP
        logprobs = [lp for r in replies for lp in r.logprobs]
        assert [lp.token_id for lp in logprobs] == [t for r in replies for t in r.token_ids]
        assert all(len(lp.top) == 2 and lp.top[0].logprob == pytest.approx(lp.logprob) for lp in logprobs)
        assert replies[-1].usage.prompt_tokens == len(prompt_ids)


def test_cancelling_the_public_grpc_call_frees_the_worker(server, model_name):
    import grpc

    from splitserve.proto.v1 import inference_pb2, inference_pb2_grpc

    [worker] = server.worker_addresses
    idle = worker_stats(worker)
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.Generate(inference_pb2.GenerateRequest(
            token_ids=inference_pb2.TokenIds(ids=PROMPT_IDS), max_tokens=3000, temperature=0, ignore_eos=True),
            timeout=60)
        assert [next(call) for _ in range(3)]
        assert worker_stats(worker).num_running == 1
        call.cancel()
        gone = time.monotonic()
    stats = wait_idle({"worker": worker}, 1.0, since=gone).stats["worker"]
    assert stats.num_aborted == idle.num_aborted + 1, stats
    assert stats.num_generated_tokens - idle.num_generated_tokens < 3000


# ---- several choices: n > 1, lists of prompts, echo ---------------------------------------------

def test_n_choices_greedy_are_identical_and_usage_counts_the_prompt_once(client, model_name, engine):
    out = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=6, temperature=0, n=3,
                                         extra_body=GREEDY)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.choices}) == 1
    single = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=6, temperature=0,
                                            extra_body=GREEDY)
    assert out.choices[0].token_ids == single.choices[0].token_ids
    assert out.usage.prompt_tokens == single.usage.prompt_tokens
    assert out.usage.completion_tokens == 3 * 6


def test_n_seeded_choices_differ_and_repeat(client, model_name):
    kwargs = dict(model=model_name, prompt=PROMPT_IDS, max_tokens=8, temperature=1.0, seed=11, n=4,
                  extra_body=GREEDY)
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    ids = [tuple(c.token_ids) for c in first.choices]
    assert ids == [tuple(c.token_ids) for c in again.choices]        # reproducible
    assert len(set(ids)) > 1                                          # and not n copies of one sample
    # Choice 0 is the sample a single request with the same seed gets.
    single = client.completions.create(**{**kwargs, "n": 1})
    assert single.choices[0].token_ids == first.choices[0].token_ids


def test_n_choices_prefill_the_prompt_once_and_share_its_kv_blocks(client, model_name, server):
    """n = 4 is one worker request: one prefill of the prompt, whose 2 full blocks the other 3
    samples share by reference and whose partial third block each gets a copy of (the
    worker's fork counters); each choice is still the sample its seed gives alone."""
    [worker] = server.worker_addresses
    prompt = list(range(2000, 2040))                 # 40 tokens: 2 full blocks of 16 + 8, not cached
    kwargs = dict(model=model_name, prompt=prompt, max_tokens=6, temperature=1.0, extra_body=GREEDY)
    before = worker_stats(worker)
    out = client.completions.create(n=4, seed=21, **kwargs)
    after = worker_stats(worker)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert after.num_requests - before.num_requests == 1
    assert after.num_prompt_tokens_computed - before.num_prompt_tokens_computed == 40
    assert after.num_forks - before.num_forks == 3
    assert after.num_forked_kv_blocks - before.num_forked_kv_blocks == 3 * 2
    assert after.num_fork_copies - before.num_fork_copies == 3
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (40, 4 * 6)
    alone = [client.completions.create(n=1, seed=21 + i, **kwargs).choices[0].token_ids for i in range(4)]
    assert [c.token_ids for c in out.choices] == alone
    wait_idle({"worker": worker}, 5.0)


def test_a_choice_stopped_by_its_stop_string_stops_its_sample_alone(client, model_name, server):
    """The frontend judges stop strings: when one of the n choices meets one, that sample alone
    is aborted on the worker (one abort counted) while the others run to max_tokens."""
    [worker] = server.worker_addresses
    kwargs = dict(model=model_name, prompt=PROMPT_IDS, max_tokens=40, temperature=1.0, seed=9, n=4,
                  extra_body=GREEDY)
    texts = [c.text for c in client.completions.create(**kwargs).choices]
    found = [(k, texts[k][i:i + 4]) for k in range(4) for i in range(0, 12)
             if texts[k][i:i + 4].strip() and not any(texts[k][i:i + 4] in t for j, t in enumerate(texts) if j != k)]
    assert found, texts
    stopped, stop = found[0]
    before = worker_stats(worker)
    out = client.completions.create(stop=[stop], **kwargs)
    wait_idle({"worker": worker}, 5.0)
    after = worker_stats(worker)
    assert [c.finish_reason for c in out.choices] == ["stop" if k == stopped else "length" for k in range(4)]
    assert [c.text for k, c in enumerate(out.choices) if k != stopped] == [t for k, t in enumerate(texts)
                                                                          if k != stopped]
    assert after.num_aborted - before.num_aborted == 1
    assert after.num_generated_tokens - before.num_generated_tokens < 4 * 40


def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob(client, model_name):
    """best_of=4, n=2 samples what n=4 samples (seed + i) and returns the two most likely of
    them, best first; without logprobs asked, none are shown, and usage counts those two."""
    kwargs = dict(model=model_name, prompt=[PROMPT_IDS, PROMPT_IDS[:6]], max_tokens=6, temperature=1.0, seed=5,
                  extra_body=GREEDY)
    all_four = client.completions.create(n=4, logprobs=0, **kwargs)
    best = client.completions.create(n=2, best_of=4, **kwargs)
    want = []
    for p in range(2):
        samples = all_four.choices[4 * p:4 * p + 4]
        ranked = sorted(samples, key=lambda c: -sum(c.logprobs.token_logprobs))
        assert len({sum(c.logprobs.token_logprobs) for c in samples}) == 4      # no ties to order
        want += [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1, 2, 3]
    assert [c.token_ids for c in best.choices] == want
    assert all(c.logprobs is None for c in best.choices)
    assert (best.usage.prompt_tokens, best.usage.completion_tokens) == (len(PROMPT_IDS) + 6, 4 * 6)


def test_batched_prompts_come_back_in_order_each_as_alone(client, model_name):
    prompts = [PROMPT_IDS, PROMPT_IDS[:4], [1, 22, 333, 4444]]
    out = client.completions.create(model=model_name, prompt=prompts, max_tokens=5, temperature=0, n=2,
                                    extra_body=GREEDY)
    assert [c.index for c in out.choices] == list(range(6))
    for p, prompt in enumerate(prompts):
        alone = client.completions.create(model=model_name, prompt=prompt, max_tokens=5, temperature=0,
                                          extra_body=GREEDY)
        assert out.choices[2 * p].token_ids == out.choices[2 * p + 1].token_ids == alone.choices[0].token_ids
    assert out.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert out.usage.completion_tokens == 6 * 5
    texts = client.completions.create(model=model_name, prompt=["Once upon", "The sky"], max_tokens=3,
                                      temperature=0)
    assert [c.index for c in texts.choices] == [0, 1]


def test_streamed_choices_interleave_and_equal_the_whole(client, model_name):
    kwargs = dict(model=model_name, prompt=[PROMPT_IDS, PROMPT_IDS[:5]], max_tokens=7, temperature=0, n=2,
                  extra_body=GREEDY)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    streamed: dict[int, list[int]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            streamed.setdefault(c.index, []).extend(c.model_extra.get("token_ids") or [])
    assert streamed == {c.index: c.token_ids for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == 4 * 7 and chunks[-1].usage.prompt_tokens == 15
    chat = list(client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=4, temperature=0, n=2,
                                               stream=True))
    roles = [c.choices[0].index for c in chat if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]


def test_echo_returns_the_prompt_before_the_completion(client, model_name):
    plain = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=5, temperature=0)
    echoed = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=5, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_name, prompt="Once upon a time", max_tokens=5, temperature=0, echo=True, stream=True)
        if c.choices)
    assert streamed == echoed.choices[0].text


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_of_a_request_with_several_choices_frees_every_one(server, model_name, stream):
    [worker] = server.worker_addresses
    aborted_before = worker_stats(worker).num_aborted
    body = {"model": model_name, "prompt": [PROMPT_IDS, PROMPT_IDS[:3]], "n": 2, "stream": stream, **LONG}
    if stream:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{server.openai_url}/completions", json=body) as reply:
                assert reply.status_code == 200
                lines = reply.iter_lines()          # held: a collected iterator closes the response
                assert [line for _, line in zip(range(8), lines) if line.startswith("data:")]
                assert worker_stats(worker).num_running == 4
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.openai_url}/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    gone = time.monotonic()
    stats = wait_idle({"worker": worker}, 1.0, since=gone).stats["worker"]
    assert stats.num_aborted == aborted_before + 4, stats


# ---- vLLM's extensions --------------------------------------------------------------------------

def test_request_id_names_the_response_and_may_be_reused(client, model_name):
    outs = [client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=3, temperature=0,
                                           extra_body={"request_id": "client-42"}) for _ in range(2)]
    assert [o.id for o in outs] == ["chatcmpl-client-42"] * 2
    cmpl = client.completions.create(model=model_name, prompt="hi", max_tokens=2, extra_body={"request_id": "x"})
    assert cmpl.id == "cmpl-x"
    # Any text: it names the body's id, never a header (the fuzzer found a newline there once).
    odd = client.completions.create(model=model_name, prompt="hi", max_tokens=2, extra_body={"request_id": "a\nb é"})
    assert odd.id == "cmpl-a\nb é"


@pytest.mark.parametrize("field, value, words", [
    ("priority", 1, "priority scheduling"),
    ("length_penalty", 0.5, "beam search"),
    ("chat_template", "{{ messages }}", "chat template"),
    ("logits_processors", ["my.module.Processor"], "server-side code"),
    ("kv_transfer_params", {"do_remote_decode": True}, "KV"),
    ("spaces_between_special_tokens", False, "only true"),
])
def test_extensions_that_make_no_sense_here_are_refused_saying_why(server, model_name, field, value, words):
    reply = httpx.post(f"{server.openai_url}/chat/completions", json={
        "model": model_name, "messages": CHAT, "max_tokens": 2, field: value}, timeout=30)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == field and words in error["message"], error


def test_include_stop_str_in_output_and_truncate_prompt_tokens(client, model_name, engine):
    [free] = generate_text(engine, [PROMPT_IDS], SamplingParams(max_tokens=16, ignore_eos=True))
    stop = free.text[len(free.text) // 2:][:3]
    out = client.completions.create(model=model_name, prompt=PROMPT_IDS, max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert out.choices[0].text == free.text[:free.text.index(stop) + len(stop)]
    cut = client.completions.create(model=model_name, prompt=PROMPT_IDS, max_tokens=6, temperature=0,
                                    extra_body={**GREEDY, "truncate_prompt_tokens": 3})
    tail = client.completions.create(model=model_name, prompt=PROMPT_IDS[-3:], max_tokens=6, temperature=0,
                                     extra_body=GREEDY)
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].token_ids == tail.choices[0].token_ids


def test_add_special_tokens_on_a_text_prompt(client, model_name):
    with_bos = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=1)
    without = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=1,
                                        extra_body={"add_special_tokens": False})
    assert without.usage.prompt_tokens == with_bos.usage.prompt_tokens - 1      # no BOS


def test_continue_final_message_and_chat_echo(client, model_name, llama_dir):
    from splitserve.checkpoints.model_source import open_checkpoint
    from splitserve.services.text.tokenizer import Tokenizer

    messages = [*CHAT, {"role": "assistant", "content": "Red, green and"}]
    out = client.chat.completions.create(model=model_name, messages=messages, max_tokens=5, temperature=0,
                                         extra_body={**GREEDY, "add_generation_prompt": False,
                                                     "continue_final_message": True, "echo": True})
    # The same as completing the template's text, cut after the assistant's words.
    tok = Tokenizer(open_checkpoint(str(llama_dir)))
    text = tok.render_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("Red, green and")
    plain = client.completions.create(model=model_name, prompt=tok.encode(text, add_special_tokens=False),
                                      max_tokens=5, temperature=0, extra_body=GREEDY)
    assert out.choices[0].token_ids == plain.choices[0].token_ids
    assert out.choices[0].message.content == "Red, green and" + plain.choices[0].text      # echo
    reply = httpx.post(f"{client.base_url}chat/completions", json={
        "model": model_name, "messages": messages, "continue_final_message": True}, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "continue_final_message"
    reply = httpx.post(f"{client.base_url}chat/completions", json={
        "model": model_name, "messages": CHAT, "chat_template_kwargs": {"messages": []}}, timeout=30)
    assert reply.status_code == 400 and "may not set messages" in reply.json()["error"]["message"]


def test_return_tokens_as_token_ids_and_continuous_usage(client, model_name):
    out = client.completions.create(model=model_name, prompt=PROMPT_IDS, max_tokens=4, temperature=0, logprobs=2,
                                    extra_body={**GREEDY, "return_tokens_as_token_ids": True})
    assert out.choices[0].logprobs.tokens == [f"token_id:{t}" for t in out.choices[0].token_ids]
    chunks = [c for c in client.completions.create(
        model=model_name, prompt=PROMPT_IDS, max_tokens=5, temperature=0, stream=True, extra_body=GREEDY,
        stream_options={"include_usage": True, "continuous_usage_stats": True})]
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 5 and all(c.usage is not None for c in chunks)


def test_public_grpc_takes_the_sampling_controls_as_http_does(server, client, model_name):
    import grpc

    from splitserve.proto.v1 import common_pb2, inference_pb2, inference_pb2_grpc

    greedy = client.completions.create(model=model_name, prompt=PROMPT_IDS, max_tokens=6, temperature=0,
                                       extra_body=GREEDY).choices[0].token_ids
    controls = {"frequency_penalty": 1.5, "presence_penalty": -1.0, "repetition_penalty": 0.7,
                "logit_bias": {str(greedy[0]): -100}, "min_tokens": 3}
    http = client.completions.create(model=model_name, prompt=PROMPT_IDS, max_tokens=6, temperature=0,
                                     extra_body={**GREEDY, **controls}).choices[0].token_ids
    assert http[0] != greedy[0]                              # the bias took the greedy token away
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(
            token_ids=inference_pb2.TokenIds(ids=PROMPT_IDS), max_tokens=6, temperature=0, ignore_eos=True,
            frequency_penalty=1.5, presence_penalty=-1.0, repetition_penalty=0.7, min_tokens=3,
            logit_bias=[common_pb2.TokenBias(token_id=greedy[0], bias=-100)])
        assert [t for r in stub.Generate(request, timeout=60) for t in r.token_ids] == http
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(inference_pb2.GenerateRequest(text="hi", presence_penalty=5), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        choice = common_pb2.StructuredOutput(kind="choice", spec='["north", "south"]')
        replies = stub.Generate(inference_pb2.GenerateRequest(text="Go", max_tokens=20, structured=choice), timeout=60)
        assert "".join(r.text for r in replies) in ("north", "south")
        with pytest.raises(grpc.RpcError) as info:
            bad = common_pb2.StructuredOutput(kind="regex", spec="[a-")
            list(stub.Generate(inference_pb2.GenerateRequest(text="Go", structured=bad), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "invalid regex" in info.value.details()


def _three_turns(client, model_name, send_back, **extra) -> list[str]:
    """A three-turn conversation; `send_back(response)` is what the client appends for each answer."""
    messages = [{"role": "user", "content": "Name a colour."}]
    answers = []
    for question in ("And another one?", "Which of the two do you prefer?", None):
        response = client.chat.completions.create(model=model_name, messages=messages, max_tokens=6, temperature=0,
                                                  **extra)
        answers.append(response.choices[0].message.content)
        messages = [*messages, send_back(response)]
        if question is not None:
            messages.append({"role": "user", "content": question})
    return answers


@pytest.mark.parametrize("with_tools", [False, True])
def test_a_conversation_continues_with_the_clients_own_message_objects(client, model_name, with_tools):
    """Clients append `response.choices[0].message` as the official client returns it (the object,
    or its dump with audio/function_call/refusal null and annotations []): vLLM accepts it, and so
    must we, with the same answers as the conversation built from plain dicts."""
    from openai.types.chat import ChatCompletionMessage

    extra = {"tools": [{"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}],
             "tool_choice": "none"} if with_tools else {}
    plain = _three_turns(client, model_name,
                         lambda r: {"role": "assistant", "content": r.choices[0].message.content}, **extra)
    as_objects = _three_turns(client, model_name, lambda r: r.choices[0].message, **extra)
    dumped = _three_turns(client, model_name, lambda r: ChatCompletionMessage(
        role="assistant", content=r.choices[0].message.content, audio=None, function_call=None, refusal=None,
        annotations=[]).model_dump(), **extra)
    assert plain == as_objects == dumped
    assert all(plain)


def test_a_custom_role_goes_to_the_chat_template(model_name, llama_server):
    """vLLM passes roles it does not know to the template; an empty role is still a 400."""
    base = llama_server.openai_url
    ok = httpx.post(f"{base}/chat/completions", timeout=60, json={
        "model": model_name, "max_tokens": 2, "messages": [{"role": "reviewer", "content": "hi"}]})
    assert ok.status_code == 200, ok.text
    bad = httpx.post(f"{base}/chat/completions", timeout=60, json={
        "model": model_name, "max_tokens": 2, "messages": [{"role": "", "content": "hi"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("messages"), bad.text
