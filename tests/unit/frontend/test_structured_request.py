"""How a request's structured-output fields become one StructuredOutput (structured.py), in
each of the three dialects clients send, and the 400s for what cannot be served."""

from __future__ import annotations

import json

import pytest

from splitserve.services.frontend.errors import APIError
from splitserve.services.frontend.http.protocol import ChatCompletionRequest, CompletionRequest
from splitserve.services.frontend.http.structured import requested_structure
from splitserve.services.worker_protocol.sampling_params import StructuredOutput

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                 **fields})


@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object", "")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, StructuredOutput("json_object", "")),
    ({"guided_json": SCHEMA}, StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"guided_regex": "[a-z]+"}, StructuredOutput("regex", "[a-z]+")),
    ({"guided_choice": ["a", "b"]}, StructuredOutput("choice", '["a", "b"]')),
    ({"guided_grammar": 'root ::= "x"', "guided_decoding_backend": "xgrammar"},
     StructuredOutput("grammar", 'root ::= "x"')),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"choice": ["y", "n"]}}, StructuredOutput("choice", '["y", "n"]')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object", "")),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
                          "triggers": ["<f>"]}},
     StructuredOutput("structural_tag", json.dumps({"structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
                                                    "triggers": ["<f>"]}))),
])
def test_each_dialect_gives_one_structured_output(fields, expected):
    assert requested_structure(_chat(**fields)) == expected
    if "guided_json" in fields or "guided_regex" in fields:
        completion = CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})
        assert requested_structure(completion) == expected


@pytest.mark.parametrize("fields, param, message", [
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "only one structured output per request"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "only one structured output"),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format type must be"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema object"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": "[1]"}, "guided_json", "must be an object"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "use xgrammar"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "no whitespace pattern"),
    ({"structured_outputs": {"frobnicate": 1}}, "structured_outputs", "unknown keys"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs", "must be a string"),
])
def test_malformed_asks_are_400s_naming_the_field(fields, param, message):
    with pytest.raises(APIError) as caught:
        requested_structure(_chat(**fields))
    assert (caught.value.status, caught.value.param) == (400, param)
    assert message in caught.value.message
