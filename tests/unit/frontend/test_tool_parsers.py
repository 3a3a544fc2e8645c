"""Tool-call parsers on outputs as the model families write them: the whole output's calls, and
the same calls assembled from the streamed deltas however the text is cut into pieces."""

from __future__ import annotations

import json
import random

import pytest

from splitserve.services.frontend.tools import parsers as p

QWEN = ('<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", '
        '"unit": "fahrenheit"}}\n</tool_call>')
HERMES_TWO = ("I'll look both up.\n<tool_call>\n{\"arguments\": {\"city\": \"東京\", \"days\": [1, 2], \"note\": "
              "\"a \\\"quoted\\\" } brace\"}, \"name\": \"forecast\"}\n</tool_call>\n<tool_call>\n"
              "{\"name\": \"search\", \"arguments\": {\"q\": \"tide tables\", \"limit\": null}}\n</tool_call>")
HERMES_UNCLOSED = '<tool_call>\n{"name": "ping", "arguments": {"host": "a.b"}}'     # EOS before the end tag
LLAMA_ONE = '{"name": "get_weather", "parameters": {"city": "Paris", "metric": true}}'
LLAMA_TWO = '<|python_tag|>{"name": "f", "parameters": {"x": 1.5}}; {"name": "g", "parameters": {}}'
REQUIRED = '[{"name": "add", "parameters": {"a": 2, "b": [3, {"c": "}]"}]}}, {"name": "noop", "parameters": {}}]'


def _calls(extracted: p.Extracted) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in extracted.calls]


def _streamed(stream, pieces: list[str]) -> tuple[str, list[tuple[str, object]]]:
    """Content and calls assembled from a stream's deltas, as a client accumulates them;
    checks each delta's shape (the first of a call: id, type and name; the rest: arguments)."""
    content, calls = "", {}
    for piece in [*pieces, None]:
        text, deltas = stream.feed(piece) if piece is not None else stream.finish()
        content += text
        for d in deltas:
            if d["index"] not in calls:
                assert d["id"].startswith("call_") and d["type"] == "function" and d["function"]["name"]
                assert d["index"] == len(calls)
                calls[d["index"]] = [d["function"]["name"], ""]
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]][1] += d["function"]["arguments"]
    return content, [(name, json.loads(args)) for name, args in calls.values()]


def _cuts(text: str) -> list[list[str]]:
    rng = random.Random(len(text))
    cuts = [[text], list(text), [text[i:i + 3] for i in range(0, len(text), 3)]]
    for _ in range(5):
        points = sorted(rng.sample(range(1, len(text)), 6))
        cuts.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)])])
    return cuts


def test_hermes_whole():
    assert _calls(p.extract_hermes(QWEN)) == [("get_current_weather", {"location": "San Francisco, CA",
                                                                         "unit": "fahrenheit"})]
    two = p.extract_hermes(HERMES_TWO)
    assert two.content == "I'll look both up.\n"
    assert _calls(two) == [("forecast", {"city": "東京", "days": [1, 2], "note": 'a "quoted" } brace'}),
                           ("search", {"q": "tide tables", "limit": None})]
    assert '"東京"' in two.calls[0].arguments          # not escaped, as vLLM writes it (ensure_ascii=False)
    assert _calls(p.extract_hermes(HERMES_UNCLOSED)) == [("ping", {"host": "a.b"})]
    assert p.extract_hermes(QWEN).content is None


@pytest.mark.parametrize("text", ["The weather is sunny.", "<tool_call>\n{not json}\n</tool_call>",
                                  '<tool_call>{"arguments": {}}</tool_call>'])
def test_hermes_output_without_a_valid_call_is_content(text):
    assert p.extract_hermes(text) == p.Extracted(text, [])


@pytest.mark.parametrize("text", [QWEN, HERMES_TWO, HERMES_UNCLOSED, "Just text, with a < sign and <tool"])
def test_hermes_stream_equals_whole(text):
    whole = p.extract_hermes(text)
    for pieces in _cuts(text):
        content, calls = _streamed(p.HermesStream(), pieces)
        assert calls == _calls(whole)
        assert content == (whole.content or "")


def test_hermes_stream_sends_the_name_before_the_arguments_and_holds_back_a_partial_tag():
    stream = p.HermesStream()
    assert stream.feed("Sure.<tool") == ("Sure.", [])
    assert stream.feed('_call>{"arguments": {"a": 1') == ("", [])           # no name yet: nothing
    content, deltas = stream.feed('}, "name": "f"}')
    assert [d["function"] for d in deltas] == [{"name": "f", "arguments": '{"a": 1}'}]


def test_llama3_json_whole_and_plain_text():
    assert _calls(p.extract_llama3_json(LLAMA_ONE)) == [("get_weather", {"city": "Paris", "metric": True})]
    assert _calls(p.extract_llama3_json(LLAMA_TWO)) == [("f", {"x": 1.5}), ("g", {})]
    assert p.extract_llama3_json(LLAMA_TWO).content is None
    text = "Paris is sunny today."
    assert p.extract_llama3_json(text) == p.Extracted(text, [])
    broken = '{"name": "f", "parameters": {"x": '
    assert p.extract_llama3_json(broken) == p.Extracted(broken, [])


@pytest.mark.parametrize("text", [LLAMA_ONE, LLAMA_TWO, " " + LLAMA_ONE, "Plain {text} here."])
def test_llama3_json_stream_equals_whole(text):
    whole = p.extract_llama3_json(text)
    for pieces in _cuts(text):
        content, calls = _streamed(p.Llama3JsonStream(), pieces)
        assert calls == _calls(whole)
        assert content == (whole.content or "")


def test_required_array_whole_and_streamed():
    whole = p.extract_required(REQUIRED)
    assert _calls(whole) == [("add", {"a": 2, "b": [3, {"c": "}]"}]}), ("noop", {})]
    for pieces in _cuts(REQUIRED):
        assert _streamed(p.RequiredStream(), pieces) == ("", _calls(whole))
    assert p.extract_required("[]").calls == [] and p.extract_required('{"name": "x"}').calls == []
    cut = REQUIRED[:REQUIRED.index('"noop"') + 10]               # max_tokens ended it in the second call
    assert _calls(p.extract_required(cut)) == _calls(whole)[:1] and p.extract_required(cut).content is None
    assert p.extract_required('[{"name": "add", "parameters": {"a"').content is not None   # no call whole


def test_named_choice_streams_its_output_as_the_arguments():
    args = '{"city": "Oslo", "days": 3}'
    assert _calls(p.extract_named(args, "forecast")) == [("forecast", {"city": "Oslo", "days": 3})]
    for pieces in _cuts(args):
        assert _streamed(p.NamedStream("forecast"), pieces) == ("", [("forecast", {"city": "Oslo", "days": 3})])


def test_a_call_without_arguments_gets_an_empty_object_when_its_object_closes():
    stream = p.RequiredStream()
    _, first = stream.feed('[{"name": "noop"')
    assert first[0]["function"] == {"name": "noop", "arguments": ""}
    _, rest = stream.feed("}]")
    assert rest == [{"index": 0, "function": {"arguments": "{}"}}]
