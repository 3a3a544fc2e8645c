"""The HTTP schema, its OpenAI-style errors, worker addresses and round-robin routing (the product's router)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from splitserve.errors import InvalidRequestError
from splitserve.proto.v1 import worker_pb2
from splitserve.services.frontend.errors import from_validation_error
from splitserve.services.frontend.http.protocol import ChatCompletionRequest, CompletionRequest
from splitserve.services.frontend.routing import RouteRequest, build_router
from splitserve.services.frontend.workers.pool import WorkerAddress, WorkerHandle, WorkerPool


def error_for(model, data):
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    return from_validation_error(info.value)


@pytest.mark.parametrize("data, param, code", [
    ({"model": "m", "prompt": "x", "frobnicate": []}, "frobnicate", "unsupported_parameter"),
    ({"prompt": "x"}, "model", "missing_required_parameter"),
    ({"model": "m", "prompt": "x", "max_tokens": "5"}, "max_tokens", "invalid_value"),
    ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens", "invalid_value"),
    ({"model": "m", "prompt": "x", "stop": ""}, "stop", "invalid_value"),
    ({"model": "m", "prompt": [-1]}, "prompt", "invalid_value"),
])
def test_completion_schema_errors(data, param, code):
    error = error_for(CompletionRequest, data)
    assert (error.status, error.param, error.code) == (400, param, code)
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_the_vllm_extensions_are_accepted_and_prompt_logprobs_not_streamed():
    chat = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1,
        "allowed_token_ids": [3], "bad_words": ["x"], "cache_salt": "s"})
    assert chat.unsupported_values() == []
    streamed = CompletionRequest.model_validate({"model": "m", "prompt": "x", "stream": True, "prompt_logprobs": 2})
    assert [p for p, _ in streamed.unsupported_values()] == ["prompt_logprobs"]      # as vLLM: whole responses only
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "stream": True,
                                             "prompt_logprobs": 0}).unsupported_values() == []
    quiet = ChatCompletionRequest.model_validate({     # what clients send by default changes nothing
        "model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "none",
        "bad_words": []})
    assert quiet.unsupported_values() == []


def test_unsupported_values_are_named():
    req = CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"], "n": 3, "echo": True})
    assert req.unsupported_values() == [] and req.prompts() == ["a", "b"] and req.num_choices == 3
    req = CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2], [3]], "echo": True, "logprobs": 1,
                                            "best_of": 4, "suffix": "x"})
    assert {p for p, _ in req.unsupported_values()} == {"suffix"}     # echo + logprobs: served
    assert req.prompts() == [[1, 2], [3]] and req.num_samples == 4 and req.num_choices == 1
    for body, why in (({"n": 3, "best_of": 2}, "between n (3) and 16"), ({"best_of": 17}, "between n"),
                      ({"n": 2, "best_of": 3, "stream": True}, "cannot be streamed")):
        [(param, message)] = CompletionRequest.model_validate({"model": "m", "prompt": "x", **body}
                                                              ).unsupported_values()
        assert param == "best_of" and why in message
    streamed = CompletionRequest.model_validate({"model": "m", "prompt": "x", "n": 2, "best_of": 2, "stream": True})
    assert streamed.unsupported_values() == [] and streamed.num_samples == 2
    assert [p for p, _ in CompletionRequest.model_validate({"model": "m", "prompt": []}).unsupported_values()] == [
        "prompt"]
    assert CompletionRequest.model_validate({"model": "m", "prompt": [5, 6]}).prompts() == [[5, 6]]
    assert error_for(CompletionRequest, {"model": "m", "prompt": "x", "n": 0}).param == "n"
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                 "logit_bias": {"5": 1.0, "x": 2.0}, "frequency_penalty": 0.0})
    assert [p for p, _ in chat.unsupported_values()] == ["logit_bias"]


def test_penalties_logit_bias_and_min_tokens_are_accepted_in_range():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "presence_penalty": -2.0,
            "frequency_penalty": 2, "repetition_penalty": 1.3, "logit_bias": {"5": -100, "7": 3.5},
            "min_tokens": 4, "stop_token_ids": [2, 9]}
    chat = ChatCompletionRequest.model_validate(body)
    assert chat.unsupported_values() == []
    assert (chat.repetition_penalty, chat.min_tokens, chat.stop_token_ids) == (1.3, 4, [2, 9])
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x", "repetition_penalty": 0.9,
                                                   "min_tokens": 1, "logit_bias": {"3": 1.0}})
    assert completion.unsupported_values() == [] and completion.min_tokens == 1
    for field, value in [("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                         ("min_tokens", -1), ("stop_token_ids.0", [-1])]:
        body = {"model": "m", "prompt": "x", field.split(".")[0]: value}
        assert error_for(CompletionRequest, body).param == field


def test_chat_fields():
    chat = ChatCompletionRequest.model_validate({
        "model": "m", "max_tokens": 5, "max_completion_tokens": 7, "logprobs": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert chat.requested_max_tokens() == 7 and chat.num_logprobs() == 0
    assert chat.messages[0].text() == "a\nb"
    assert error_for(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}).status == 400


def test_worker_address_parsing():
    assert WorkerAddress.parse("decode=127.0.0.1:5") == WorkerAddress("decode", "127.0.0.1:5")
    assert WorkerAddress.parse("127.0.0.1:5").role == "both"
    for bad in ("chef=127.0.0.1:5", "both=nowhere"):
        with pytest.raises(InvalidRequestError):
            WorkerAddress.parse(bad)


def _handle(name: str, role: str, ready: bool = True) -> WorkerHandle:
    info = worker_pb2.DescribeResponse(worker_id=name, max_model_len=100)
    return WorkerHandle(name, role, f"{name}:1", channel=None, stub=None, ready=ready, info=info)


def test_round_robin_over_each_leg():
    pool = WorkerPool([_handle("d0", "decode"), _handle("d1", "decode"), _handle("d2", "decode", ready=False),
                       _handle("p0", "prefill"), _handle("p1", "prefill")])
    # Threshold 0: a one-token prompt is worth a remote prefill, so both legs rotate.
    router = build_router(pool, "round-robin", remote_prefill_threshold=0)
    routes = [router.route(RouteRequest("r", [1])) for _ in range(4)]
    assert [r.decode.worker_id for r in routes] == ["d0", "d1", "d0", "d1"]
    assert [r.prefill.worker_id for r in routes] == ["p0", "p1", "p0", "p1"]
    assert router.route(RouteRequest("r", [1]), exclude=frozenset({"d0", "d1"})) is None
    aggregated = build_router(WorkerPool([_handle("a0", "both")]), "round-robin")
    route = aggregated.route(RouteRequest("r", [1]))
    assert route.decode.worker_id == "a0" and route.prefill is None
