"""/tokenize, /detokenize and /v1/responses below the workers: schemas, refusals, events.

The real app (build_app) over a real tokenizer answers /tokenize and /detokenize
through httpx's in-process ASGI transport; /v1/responses is prepared by the real
generation route and its events come from the real formatter fed Deltas. Only the
worker pool is a stand-in reporting one ready decode worker. End to end, with
workers and the official client: tests/integration/serving/test_openai_endpoints.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import orjson
import pytest

from splitserve.checkpoints.model_source import open_checkpoint
from splitserve.services.frontend.core import Delta, Frontend
from splitserve.services.frontend.errors import APIError
from splitserve.services.frontend.http.app import build_app
from splitserve.services.frontend.http.generation import GenerationEndpoints
from splitserve.services.frontend.http.responses_api import ResponsesRoute
from splitserve.services.frontend.metrics import FrontendMetrics
from splitserve.services.text.tokenizer import Tokenizer

MODEL = "served"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]


class ReadyPool:
    def __init__(self, ready: bool = True):
        self.workers = [SimpleNamespace(info=SimpleNamespace(model_name=MODEL, max_model_len=256))]
        self._ready = ready

    def ready(self, role_filter=None):
        return self.workers if self._ready else []

    def all_ready(self):
        return self._ready


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return Tokenizer(open_checkpoint(str(llama_dir)))


@pytest.fixture(scope="module")
def frontend(tokenizer):
    return Frontend(tokenizer, ReadyPool(), None, FrontendMetrics(), MODEL)


def post(frontend, path: str, body: dict) -> httpx.Response:
    async def run():
        transport = httpx.ASGITransport(app=build_app(frontend))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body)
    return asyncio.run(run())


def test_tokenize_text_and_its_options(frontend, tokenizer):
    out = post(frontend, "/tokenize", {"model": MODEL, "prompt": "Hello world"}).json()
    assert out["tokens"] == tokenizer.encode("Hello world") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 256 and out["token_strs"] is None
    bare = post(frontend, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False,
                                        "return_token_strs": True}).json()
    assert bare["tokens"] == out["tokens"][1:]           # no model: the served one; no BOS
    assert bare["token_strs"] == [tokenizer.id_to_token(t) for t in bare["tokens"]]


def test_tokenize_chat_uses_the_template(frontend, tokenizer):
    out = post(frontend, "/tokenize", {"model": MODEL, "messages": CHAT}).json()
    assert out["tokens"] == tokenizer.apply_chat_template(CHAT)      # what a chat completion prompts
    closed = post(frontend, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert closed["tokens"] == tokenizer.apply_chat_template(CHAT, add_generation_prompt=False)
    unused = post(frontend, "/tokenize", {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert unused.json()["tokens"] == out["tokens"]      # variables reach the template (this one reads none)
    history = [*CHAT, {"role": "assistant", "content": "Red, blue"}]
    ended = post(frontend, "/tokenize", {"messages": history, "add_generation_prompt": False}).json()
    open_ = post(frontend, "/tokenize", {"messages": history, "add_generation_prompt": False,
                                         "continue_final_message": True}).json()
    assert post(frontend, "/detokenize", {"tokens": ended["tokens"]}).json()["prompt"].endswith(
        "Red, blue" + tokenizer.eos_token)
    text = post(frontend, "/detokenize", {"tokens": open_["tokens"]}).json()["prompt"]
    assert text.endswith("Red, blue")                    # the assistant turn is left open: no EOS
    assert open_["tokens"] == ended["tokens"][:open_["count"]] and open_["count"] < ended["count"]


def test_detokenize_round_trips(frontend, tokenizer):
    for text in ("Hello world", "naïve café 日本語 ✓"):
        ids = post(frontend, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
        assert post(frontend, "/detokenize", {"model": MODEL, "tokens": ids}).json() == {"prompt": text}
    with_bos = post(frontend, "/tokenize", {"prompt": "Hello"}).json()["tokens"]
    spelled = post(frontend, "/detokenize", {"tokens": with_bos}).json()["prompt"]
    assert spelled == tokenizer.decode(with_bos, skip_special_tokens=False)
    assert spelled.startswith(tokenizer.bos_token)       # special tokens are kept, as in vLLM


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"prompt": "x", "tools": []}, 400, "tools"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, 400, "messages"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_tokenization_refusals(frontend, path, body, status, param):
    response = post(frontend, path, body)
    assert response.status_code == status
    assert response.json()["error"]["param"] == param


def test_tokenize_waits_for_a_worker(tokenizer):
    idle = Frontend(tokenizer, ReadyPool(ready=False), None, FrontendMetrics(), MODEL)
    assert post(idle, "/tokenize", {"prompt": "x"}).status_code == 503
    assert post(idle, "/detokenize", {"tokens": [1]}).status_code == 503


# -- /v1/responses ---------------------------------------------------------------------
def prepare(frontend, **fields):
    body = {"model": MODEL, "input": "hi", **fields}
    return ResponsesRoute(GenerationEndpoints(None, frontend)).prepare(orjson.dumps(body))


def test_responses_prompt_is_the_chat_prompt(frontend, tokenizer):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name three colours."}]}]
    req = prepare(frontend, instructions="Be brief.", input=items, max_output_tokens=7, temperature=0.5, top_p=0.9)
    assert req.gen.prompt_ids == tokenizer.apply_chat_template(CHAT)
    assert (req.gen.params.max_tokens, req.gen.params.temperature, req.gen.params.top_p) == (7, 0.5, 0.9)
    assert req.gen.api == "responses" and not req.stream
    plain = prepare(frontend, input="Name three colours.", stream=True)
    assert plain.gen.prompt_ids == tokenizer.apply_chat_template([CHAT[1]]) and plain.stream
    # An earlier response's output item, passed back as history, and a developer message.
    history = [{"role": "developer", "content": "Be brief."}, CHAT[1],
               {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "Red.", "annotations": []}]},
               {"role": "user", "content": "More?"}]
    want = [*CHAT, {"role": "assistant", "content": "Red."}, {"role": "user", "content": "More?"}]
    assert prepare(frontend, input=history).gen.prompt_ids == tokenizer.apply_chat_template(want)


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input"),
    ({"temperature": 3}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "word " * 300}, "input"),                  # longer than the 256-token context
    ({"frequency_penalty": 1.0}, "frequency_penalty"),
    ({"model": "other"}, "model"),
])
def test_responses_refusals(frontend, fields, param):
    with pytest.raises(APIError) as info:
        prepare(frontend, **fields)
    assert info.value.param == param and info.value.status in (400, 404)


def test_responses_accepts_what_means_plain_text(frontend):
    req = prepare(frontend, store=False, tools=[], tool_choice="none", background=False, include=[],
                  text={"format": {"type": "text"}}, truncation="disabled", metadata={"k": "v"}, user="u")
    assert req.formatter.full([_delta("x", "stop")])["metadata"] == {"k": "v"}


def _delta(text: str, finish: str | None, num_output: int = 1) -> Delta:
    return Delta(text, [1], [], finish, 5, 2, num_output)


def test_responses_events_and_whole(frontend):
    fmt = prepare(frontend, stream=True, max_output_tokens=3).formatter
    events = [*fmt.opening(), *fmt.chunks(_delta("Hel", None)), *fmt.chunks(_delta("", None)),
              *fmt.chunks(_delta("lo", "length", 3)), *fmt.closing()]
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    item_ids = {e["item_id"] for e in events if "item_id" in e} | {e["item"]["id"] for e in events if "item" in e}
    assert len(item_ids) == 1
    done = events[-1]["response"]
    assert done["id"] == fmt.request_id and done["object"] == "response"
    assert done["status"] == "incomplete" and done["incomplete_details"] == {"reason": "max_output_tokens"}
    assert done["output"][0]["content"][0]["text"] == "Hello" == events[6]["text"]
    assert done["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 3,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8}
    whole = prepare(frontend).formatter.full([_delta("Hel", None), _delta("lo", "stop", 2)])
    assert whole["status"] == "completed" and whole["incomplete_details"] is None
    assert whole["output"][0]["status"] == "completed" and whole["output"][0]["content"][0]["text"] == "Hello"
