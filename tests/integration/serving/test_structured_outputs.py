"""Structured outputs through `splitserve serve` with the official `openai` client, in each
dialect clients send: the client's own `chat.completions.parse` with a pydantic model,
response_format json_schema streamed, vLLM's guided_* and structured_outputs, with n > 1.

On the random-weight Llama: it never closes a string or picks a listed word by
itself, so an output that parses and validates is the grammar's doing. A bad schema
is a 400 that names what is wrong, and the server serves on.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

CHAT = [{"role": "user", "content": "Describe a person."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "tags"], "additionalProperties": False}


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    colour: Literal["red", "green", "blue"]


def test_the_clients_parse_helper_gets_a_valid_pydantic_object(client, model_name):
    for seed in (None, 4):
        sampling = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
        reply = client.chat.completions.parse(model=model_name, messages=CHAT, response_format=Person,
                                              max_tokens=200, **sampling)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)
        assert Person.model_validate_json(choice.message.content) == choice.message.parsed


def test_a_streamed_json_schema_reply_validates(client, model_name):
    stream = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=200, stream=True, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}})
    parts, reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert len(parts) > 3 and reasons[-1] == "stop"
    jsonschema.validate(json.loads("".join(parts)), SCHEMA)


def test_vllm_guided_fields_and_structured_outputs(client, model_name):
    def complete(n: int = 1, **extra):
        return client.completions.create(model=model_name, prompt="The answer is", max_tokens=60, n=n,
                                         temperature=1.0, seed=9, extra_body=extra).choices

    choices = ["Paris", "Lyon", "Marseille"]
    assert all(c.text in choices for c in complete(n=3, guided_choice=choices))
    assert all(c.text in choices for c in complete(structured_outputs={"choice": choices}))
    [regex] = complete(guided_regex=r"[0-9]{3}-[a-z]{2}")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", regex.text), regex.text
    [grammar] = complete(guided_grammar='root ::= "yes" | "no"', guided_decoding_backend="xgrammar")
    assert grammar.text in ("yes", "no")
    for reply in complete(n=2, guided_json=SCHEMA) + complete(structured_outputs={"json": json.dumps(SCHEMA)}):
        jsonschema.validate(json.loads(reply.text), SCHEMA)
    [obj] = complete(response_format={"type": "json_object"})
    assert obj.text.startswith("{")


@pytest.mark.parametrize("extra, message", [
    ({"guided_json": {"type": "bogus"}}, "invalid JSON schema: Unsupported type"),
    ({"guided_regex": "[a-"}, "invalid regex"),
    ({"guided_grammar": "root ::= nowhere"}, "invalid EBNF grammar"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "only one structured output per request"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "use xgrammar"),
])
def test_a_bad_structure_is_a_400_and_the_server_serves_on(client, model_name, extra, message):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model_name, prompt="x", max_tokens=4, extra_body=extra)
    assert message in caught.value.message
    assert client.completions.create(model=model_name, prompt="x", max_tokens=2).choices[0].finish_reason
