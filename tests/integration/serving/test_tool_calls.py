"""Tool calls with the official `openai` client against real processes: one worker serving the
shipped SmolLM2, one `splitserve frontend` started with `--enable-auto-tool-choice
--tool-call-parser hermes` and one without.

`tool_choice="required"` and a named function are forced by structured outputs (the engine's
grammar), so even a model that was never taught these tools answers with calls whose
arguments validate against the tools' schemas; the streamed call folds into the same calls
with the client's `chat.completions.stream()` helper, strict `pydantic_function_tool`s parse
into their models, and finish_reason is OpenAI's. A conversation that carries earlier calls
and tool results is accepted, and `auto` without the server's flags is vLLM's 400. Over one
prefill and one decode worker (the first token sampled on the prefill worker, under the
grammar) a greedy required call is the aggregated worker's.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from splitserve.testing.cluster import Cluster
from splitserve.testing.workers import worker_stats

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone", "strict": True,
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


class Forecast(BaseModel):
    """Tomorrow's forecast for a city."""

    city: Literal["Paris", "Oslo", "Rome"]
    rain: bool


@pytest.fixture(scope="module")
def cluster(smollm2_dir):
    c = Cluster(smollm2_dir, kv_cache_gib=0.1)
    try:
        c.start_worker("worker-0", "both")
        c.wait_workers()
        c.auto = c.start_frontend("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
        c.plain = c.start_frontend()
        c.auto.wait_ready()
        c.plain.wait_ready()
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def disaggregated(smollm2_dir):
    """1 prefill + 1 decode worker: every prompt is prefilled remotely (threshold 1 token), so the
    grammar's first token is sampled on the prefill worker."""
    c = Cluster(smollm2_dir, kv_cache_gib=0.1)
    try:
        c.start_worker("prefill-0", "prefill")
        c.start_worker("decode-0", "decode", "--remote-prefill-threshold", "1")
        c.wait_workers()
        c.front = c.start_frontend("--remote-prefill-threshold", "1")
        c.front.wait_ready()
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.auto.openai_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _validated(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


@pytest.mark.parametrize("temperature, parallel", [(0.0, True), (1.0, True), (1.0, False)])
def test_required_always_yields_calls_that_validate(client, model, temperature, parallel):
    """Sampled, a model may go on adding calls until max_tokens: the calls written whole are
    still returned (finish_reason "length" says it was cut); parallel_tool_calls=false allows
    exactly one call, so it always finishes."""
    out = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                         max_tokens=120, temperature=temperature, seed=3, n=4,
                                         parallel_tool_calls=parallel)
    for choice in out.choices:
        assert choice.message.tool_calls and not choice.message.content, choice
        for call in choice.message.tool_calls:
            _validated(call)
        finished = ("tool_calls",) if temperature == 0 or not parallel else ("tool_calls", "length")
        assert choice.finish_reason in finished, choice
        if not parallel:
            assert len(choice.message.tool_calls) == 1


def test_named_choice_yields_that_function(client, model):
    out = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=60,
                                         tool_choice={"type": "function", "function": {"name": "get_time"}})
    [choice] = out.choices
    assert choice.finish_reason == "stop"                      # OpenAI's answer for a forced function
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time" and _validated(call)["zone"] in ("UTC", "CET")


def test_streamed_required_call_folds_with_the_clients_helper(client, model):
    whole = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=120, temperature=0)
    with client.chat.completions.stream(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                        max_tokens=120, temperature=0) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in events and "tool_calls.function.arguments.done" in events
    [choice] = final.choices
    assert choice.finish_reason == "tool_calls"
    streamed = [(c.function.name, _validated(c)) for c in choice.message.tool_calls]
    assert streamed == [(c.function.name, json.loads(c.function.arguments)) for c in whole.choices[0].message.tool_calls]


def test_strict_pydantic_tool_parses_into_its_model(client, model):
    tool = openai.pydantic_function_tool(Forecast)
    with client.chat.completions.stream(model=model, messages=[{"role": "user", "content": "Rain in Oslo?"}],
                                        tools=[tool], max_tokens=60,
                                        tool_choice={"type": "function", "function": {"name": "Forecast"}}) as stream:
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Forecast)
    parsed = client.chat.completions.parse(model=model, messages=ASK, tools=[tool], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=80)
    assert isinstance(parsed.choices[0].message.tool_calls[0].function.parsed_arguments, Forecast)


def test_a_conversation_with_calls_and_results_continues(client, model):
    first = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=120, temperature=0)
    message = first.choices[0].message
    results = [{"role": "tool", "tool_call_id": c.id, "content": "18 C, sunny"} for c in message.tool_calls]
    follow = client.chat.completions.create(model=model, messages=[*ASK, message, *results], tools=[WEATHER],
                                            tool_choice="none", max_tokens=20, temperature=0)
    assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls


def test_streamed_named_call_is_openais_deltas(client, model):
    """The chunks as OpenAI sends them: the call's index, id, type and name once, then only
    argument fragments, which join to the whole response's arguments (greedy: the same tokens)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice=named,
                                           max_tokens=40, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice=named,
                                                 max_tokens=40, temperature=0, stream=True))
    calls = [c for chunk in chunks for choice in chunk.choices for c in choice.delta.tool_calls or []]
    first, rest = calls[0], calls[1:]
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather") and first.id
    assert all(c.index == 0 and c.id is None and c.function.name is None for c in rest)
    [call] = whole.choices[0].message.tool_calls
    assert "".join(c.function.arguments for c in calls) == call.function.arguments
    assert [ch.finish_reason for chunk in chunks for ch in chunk.choices][-1] == whole.choices[0].finish_reason


def test_auto_reads_content_with_the_parser_and_is_refused_without_it(cluster, client, model):
    out = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=16, temperature=0)
    choice = out.choices[0]
    assert choice.message.tool_calls is None and choice.message.content    # SmolLM2 writes no <tool_call>
    assert choice.finish_reason in ("stop", "length")
    reply = httpx.post(f"{cluster.plain.openai_url}/chat/completions", timeout=60, json={
        "model": model, "messages": ASK, "tools": [WEATHER], "max_tokens": 4})
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == ('"auto" tool choice requires --enable-auto-tool-choice and '
                                                '--tool-call-parser to be set')
    plain = openai.OpenAI(base_url=cluster.plain.openai_url, api_key="unused", max_retries=0, timeout=300)
    named = plain.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=60,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"   # needs no parser


def test_required_over_one_prefill_and_one_decode_worker_is_the_same_call(client, model, disaggregated):
    remote = openai.OpenAI(base_url=disaggregated.front.openai_url, api_key="unused", max_retries=0, timeout=300)
    ask = [{"role": "user", "content": "Which city is the capital of Italy? Then tell me its weather."}]
    prefill = disaggregated.workers["prefill-0"].address
    before = worker_stats(prefill).num_prefills_served
    with remote.chat.completions.stream(model=model, messages=ask, tools=[WEATHER, TIME], tool_choice="required",
                                        max_tokens=120, temperature=0) as stream:
        split = stream.get_final_completion().choices[0]
    assert worker_stats(prefill).num_prefills_served == before + 1
    local = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER, TIME], tool_choice="required",
                                           max_tokens=120, temperature=0).choices[0]
    assert split.finish_reason == local.finish_reason == "tool_calls"
    assert [(c.function.name, _validated(c)) for c in split.message.tool_calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in local.message.tool_calls]


def test_a_tool_schema_the_grammar_cannot_take_is_a_400(client, model):
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "no-such-type"}}}}}
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=model, messages=ASK, tools=[bad], tool_choice=choice, max_tokens=8)
    assert client.chat.completions.create(model=model, messages=ASK, max_tokens=2).choices   # still serving
