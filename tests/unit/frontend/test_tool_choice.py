"""tools and tool_choice on /v1/chat/completions: the template sees the tools and the tool
messages, each choice gets vLLM's grammar or parser, refusals are vLLM's, and the response
carries OpenAI's tool_calls (whole and streamed) with its finish_reason."""

from __future__ import annotations

import json
from types import SimpleNamespace

import orjson
import pytest

from splitserve.checkpoints.model_source import open_checkpoint
from splitserve.services.frontend.core import Delta, Frontend
from splitserve.services.frontend.errors import APIError
from splitserve.services.frontend.http.generation import GenerationEndpoints
from splitserve.services.frontend.metrics import FrontendMetrics
from splitserve.services.frontend.tools.choice import AUTO_NEEDS_PARSER, required_schema
from splitserve.services.text.tokenizer import Tokenizer

MODEL = "served"
TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
            "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
            "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}</{{ m.role }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now"}}
USER = [{"role": "user", "content": "Weather in Oslo?"}]


class ReadyPool:
    workers = [SimpleNamespace(info=SimpleNamespace(model_name=MODEL, max_model_len=512))]

    def ready(self, role_filter=None):
        return self.workers


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    tok = Tokenizer(open_checkpoint(str(llama_dir)))
    tok.chat_template = TEMPLATE
    return tok


def _endpoints(tokenizer, parser: str | None = None) -> GenerationEndpoints:
    frontend = Frontend(tokenizer, ReadyPool(), None, FrontendMetrics(), MODEL)
    frontend.tool_parser = parser
    return GenerationEndpoints(None, frontend)


def prepare(tokenizer, parser=None, **fields):
    body = {"model": MODEL, "messages": USER, "max_tokens": 20, **fields}
    return _endpoints(tokenizer, parser).prepare_chat(orjson.dumps(body))


def _refusal(tokenizer, parser=None, **fields) -> APIError:
    with pytest.raises(APIError) as info:
        prepare(tokenizer, parser, **fields)
    assert info.value.status == 400
    return info.value


def test_tools_and_tool_messages_reach_the_template(tokenizer):
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    req = prepare(tokenizer, "hermes", messages=history, tools=[WEATHER, CLOCK])
    text = tokenizer.render_chat([
        *USER, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": "call_1"}], variables={"tools": [WEATHER, CLOCK]})
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert "<tool>Sunny, 21 C[call_1]</tool>" in text
    assert req.gen.prompt_ids == tokenizer.encode(text, add_special_tokens=False)
    assert req.gen.params.structured is None          # auto: parsed, not forced


def test_tokenize_counts_the_prompt_a_chat_with_tools_sends(tokenizer):
    from splitserve.services.frontend.http.tokenization import parse_tokenize, tokenize

    history = [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    endpoints = _endpoints(tokenizer, "hermes")
    chat = endpoints.prepare_chat(orjson.dumps({"model": MODEL, "messages": history, "tools": [CLOCK]}))
    counted = tokenize(endpoints.frontend, parse_tokenize(orjson.dumps({"messages": history, "tools": [CLOCK]})))
    assert counted["tokens"] == chat.gen.prompt_ids
    with pytest.raises(APIError):
        parse_tokenize(orjson.dumps({"messages": [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]}))


def test_tool_choice_none_renders_the_tools_and_reads_content(tokenizer):
    req = prepare(tokenizer, tools=[WEATHER], tool_choice="none")
    assert req.gen.params.structured is None and req.formatter.tools is None
    with_tools = tokenizer.apply_chat_template(USER, variables={"tools": [WEATHER]})
    assert req.gen.prompt_ids == with_tools != tokenizer.apply_chat_template(USER)


def test_auto_needs_the_server_flags(tokenizer):
    for fields in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
        error = _refusal(tokenizer, **fields)
        assert error.message == AUTO_NEEDS_PARSER and error.param == "tool_choice"
    assert prepare(tokenizer, "llama3_json", tools=[WEATHER]).formatter.tools.setup.mode == "auto"


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"),                       # tool_choice without tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages.0.tool_calls"),
])
def test_refusals(tokenizer, fields, param):
    assert _refusal(tokenizer, "hermes", **fields).param.startswith(param)


def test_an_empty_tools_list_changes_nothing(tokenizer):
    for choice in ("none", "required", "auto"):
        req = prepare(tokenizer, tools=[], tool_choice=choice)
        assert req.gen.params.structured is None and req.formatter.tools is None
        assert req.gen.prompt_ids == tokenizer.apply_chat_template(USER)


def test_required_forces_vllms_array_of_calls(tokenizer):
    req = prepare(tokenizer, tools=[WEATHER, CLOCK], tool_choice="required", n=2)
    for choice in req.choices:
        structured = choice.gen.params.structured
        assert structured.kind == "json_schema"
        assert json.loads(structured.spec) == {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                            "parameters": WEATHER["function"]["parameters"]}, "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["now"]},
                            "parameters": {"type": "object", "properties": {}}}, "required": ["name", "parameters"]}]}}
    assert req.choices[0].formatter.tools is not req.choices[1].formatter.tools      # one reader per choice
    single = prepare(tokenizer, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False)
    assert json.loads(single.gen.params.structured.spec)["maxItems"] == 1


def test_named_choice_forces_the_functions_parameters(tokenizer):
    req = prepare(tokenizer, tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(req.gen.params.structured.spec) == WEATHER["function"]["parameters"]
    req = prepare(tokenizer, tools=[CLOCK], tool_choice={"type": "function", "function": {"name": "now"}})
    assert json.loads(req.gen.params.structured.spec) == {"type": "object", "properties": {}}


def test_required_hoists_defs_and_refuses_two_different_ones():
    item = {"type": "object", "properties": {"n": {"type": "integer"}}}
    a = {"type": "object", "properties": {"x": {"$ref": "#/$defs/Item"}}, "$defs": {"Item": item}}
    b = {"type": "object", "properties": {"y": {"$ref": "#/$defs/Item"}}, "$defs": {"Item": item}}
    schema = required_schema({"a": a, "b": b})
    assert schema["$defs"] == {"Item": item} and "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" in a                                        # the request's schema is left as it was
    with pytest.raises(ValueError, match="multiple schemas"):
        required_schema({"a": a, "b": {**b, "$defs": {"Item": {"type": "string"}}}})


def _delta(text: str, finish: str | None = None) -> Delta:
    return Delta(text, [1], [], finish, 5, 0, 1)


def test_required_whole_response(tokenizer):
    fmt = prepare(tokenizer, tools=[WEATHER, CLOCK], tool_choice="required").formatter
    out = fmt.full([_delta('[{"name": "get_weather", "parameters": {"city": '), _delta('"Oslo"}}]', "stop")])
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_named_choice_whole_and_streamed(tokenizer):
    named = {"type": "function", "function": {"name": "get_weather"}}
    fmt = prepare(tokenizer, tools=[WEATHER], tool_choice=named).formatter
    choice = fmt.full([_delta('{"city": "Oslo"}', "stop")])["choices"][0]
    assert choice["finish_reason"] == "stop"                  # OpenAI: a forced function stops
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    fmt = prepare(tokenizer, tools=[WEATHER], tool_choice=named, stream=True).formatter
    chunks = [c["choices"][0] for d in (_delta('{"ci'), _delta('ty": "Oslo"}'), _delta("", "stop"))
              for c in fmt.chunks(d)]
    first = chunks[0]["delta"]["tool_calls"][0]
    assert first["function"] == {"name": "get_weather", "arguments": '{"ci'} and first["index"] == 0
    assert chunks[1]["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]}
    assert chunks[2]["delta"] == {} and chunks[2]["finish_reason"] == "stop"


def test_auto_hermes_streamed_content_then_calls(tokenizer):
    fmt = prepare(tokenizer, "hermes", tools=[WEATHER, CLOCK], stream=True).formatter
    pieces = ["Checking.", "<tool_", 'call>\n{"name": "now", "arguments": {}}\n</tool_call>', ""]
    chunks = [c["choices"][0] for i, text in enumerate(pieces)
              for c in fmt.chunks(_delta(text, "stop" if i == len(pieces) - 1 else None))]
    assert chunks[0]["delta"] == {"content": "Checking."} and chunks[1]["delta"] == {}
    assert chunks[2]["delta"]["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_auto_without_a_call_is_content_and_parallel_false_keeps_one_call(tokenizer):
    fmt = prepare(tokenizer, "hermes", tools=[WEATHER]).formatter
    choice = fmt.full([_delta("It is sunny.", "stop")])["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny."} and choice["finish_reason"] == "stop"
    fmt = prepare(tokenizer, "llama3_json", tools=[WEATHER, CLOCK], parallel_tool_calls=False).formatter
    two = '{"name": "now", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Rome"}}'
    message = fmt.full([_delta(two, "stop")])["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["now"]
    length = prepare(tokenizer, "llama3_json", tools=[CLOCK]).formatter.full([_delta('{"name": "now"}', "length")])
    assert length["choices"][0]["finish_reason"] == "length"       # cut short: not a finished call


@pytest.mark.parametrize("given, parser", [([], None), (["--tool-call-parser", "hermes"], None),
                                           (["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"],
                                            "llama3_json")])
def test_serve_forwards_the_tool_flags_to_its_frontends(given, parser):
    from splitserve.services.cli.commands import check_tool_args
    from splitserve.services.cli.parsers import build_parser
    from splitserve.services.launch.children import frontend_argv

    cli = build_parser()
    argv = frontend_argv(cli.parse_args(["serve", *given]), "/m", "127.0.0.1", 8000, 8001, [], [])
    assert check_tool_args(cli.parse_args(["frontend", "--worker", "both=127.0.0.1:1", *argv])) == parser


def test_auto_tool_choice_without_a_parser_is_a_startup_error():
    from splitserve.errors import SplitserveError
    from splitserve.services.cli.commands import check_tool_args
    from splitserve.services.cli.parsers import build_parser

    with pytest.raises(SplitserveError, match="--tool-call-parser"):
        check_tool_args(build_parser().parse_args(["serve", "--enable-auto-tool-choice"]))


# Qwen 2.5's template, its tool parts (tools into the system message, calls as <tool_call> JSON,
# results as <tool_response> in a user turn).
QWEN_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% endif %}{%- for message in messages %}
{%- if message.role == "user" or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}{{- '<|im_start|>assistant' }}
{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


def test_a_parsed_call_sent_back_renders_as_the_model_wrote_it(llama_dir):
    """Hermes output -> tool_calls -> the next request's assistant message -> the template
    writes the same <tool_call> text again (the conversation the model sees is its own)."""
    tok = Tokenizer(open_checkpoint(str(llama_dir)))
    tok.chat_template = QWEN_TEMPLATE
    written = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    fmt = prepare(tok, "hermes", tools=[WEATHER]).formatter
    message = fmt.full([_delta(written, "stop")])["choices"][0]["message"]
    history = [*USER, message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "9 C"}]
    req = prepare(tok, "hermes", tools=[WEATHER], messages=history)
    text = tok.render_chat([template_message_of(m) for m in history], variables={"tools": [WEATHER]})
    assert f"<|im_start|>assistant\n{written}<|im_end|>\n" in text
    assert "<tool_response>\n9 C\n</tool_response>" in text and '"name": "get_weather", "description"' in text
    assert req.gen.prompt_ids == tok.encode(text, add_special_tokens=False)


def template_message_of(message: dict) -> dict:
    from splitserve.services.frontend.http.protocol import ChatMessage
    from splitserve.services.frontend.tools.choice import template_message

    return template_message(ChatMessage.model_validate(message))
