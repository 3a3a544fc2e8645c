"""Structured outputs in the engine (services/engine/grammar.py) on the random-weight Llama.

A random model never ends a string or closes an object by itself, so whatever it
emits under a grammar is the grammar's doing: every output must match its JSON
schema (50 hypothesis schemas), regex, choice list or EBNF grammar, greedy and
sampled. Unconstrained rows batched with constrained ones are unchanged. A request
resumed from its prompt plus a cut of its output (as a migration or a decode worker
continuing a remote prefill does) continues token for token as the unbroken run.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings

from splitserve.errors import InvalidRequestError
from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.worker_protocol.sampling_params import SamplingParams, StructuredOutput
from splitserve.testing.json_schemas import bounded_schemas

PROMPT = [1, 415, 2936, 9060, 285, 1142, 28705]
MAX_TOKENS = 400            # far above what any bounded schema's instance needs
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(llama_dir):
    e = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=256, num_threads=1))
    yield e
    e.close()


def _text(engine, spec: StructuredOutput, **params) -> tuple[str, str]:
    [r] = engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, structured=spec, **params))
    return engine.tokenizer.decode(r.token_ids), r.finish_reason.value


@settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=bounded_schemas())
def test_every_output_validates_against_its_schema(engine, schema):
    for params in ({}, {"temperature": 1.0, "seed": 3}):
        text, reason = _text(engine, StructuredOutput("json_schema", json.dumps(schema)), **params)
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("params", [{}, {"temperature": 1.0, "seed": 11}])
def test_regex_choice_grammar_and_json_object(engine, params):
    text, _ = _text(engine, StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,4}"), **params)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
    choices = ["Paris", "Lyon", "Marseille"]
    text, _ = _text(engine, StructuredOutput("choice", json.dumps(choices)), **params)
    assert text in choices
    text, _ = _text(engine, StructuredOutput("grammar", 'root ::= "yes" | "no" | "maybe " [0-9]'), **params)
    assert re.fullmatch(r"yes|no|maybe [0-9]", text), text
    # Any JSON object: a random model may fill max_tokens; what it wrote is still an object's start.
    [r] = engine.generate([PROMPT], SamplingParams(max_tokens=20, structured=StructuredOutput("json_object", ""),
                                                   **params))
    assert engine.tokenizer.decode(r.token_ids).startswith("{")


def test_unconstrained_rows_in_the_batch_are_unchanged(engine):
    free = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = [r.token_ids for r in engine.generate([PROMPT, PROMPT[:4]], free)]
    constrained = SamplingParams(max_tokens=MAX_TOKENS, structured=StructuredOutput("json_schema", json.dumps(PERSON)))
    mixed = engine.generate([PROMPT, PROMPT, PROMPT[:4]], [free, constrained, free])
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone
    jsonschema.validate(json.loads(engine.tokenizer.decode(mixed[1].token_ids)), PERSON)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 5}])
@pytest.mark.parametrize("cut", [1, 5])
def test_a_resumed_request_continues_the_grammar_exactly(engine, sampling, cut):
    spec = StructuredOutput("json_schema", json.dumps(PERSON))
    [whole] = engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, structured=spec, **sampling))
    assert len(whole.token_ids) > cut + 1
    resumed = SamplingParams(max_tokens=MAX_TOKENS - cut, structured=spec, num_prior_output_tokens=cut,
                             num_prior_draws=cut if sampling else 0, **sampling)
    [rest] = engine.generate([PROMPT + whole.token_ids[:cut]], resumed)
    assert whole.token_ids[:cut] + rest.token_ids == whole.token_ids


def test_the_grammar_wins_over_min_tokens(engine):
    """min_tokens holds EOS back, but a finished choice allows nothing else: EOS it is."""
    [r] = engine.generate([PROMPT], SamplingParams(max_tokens=10, min_tokens=5,
                                                   structured=StructuredOutput("choice", '["yes"]')))
    assert engine.tokenizer.decode(r.token_ids) == "yes" and r.finish_reason.value == "stop"


@pytest.mark.parametrize("spec, message", [
    (StructuredOutput("json_schema", '{"type": "bogus"}'), "invalid JSON schema: Unsupported type"),
    (StructuredOutput("regex", "[a-"), "invalid regex"),
    (StructuredOutput("grammar", "root ::= undefined_rule"), "invalid EBNF grammar"),
    (StructuredOutput("choice", "[]"), "guided_choice must be a non-empty list"),
    (StructuredOutput("choice", "not json"), "invalid choice list: not JSON"),
])
def test_bad_specs_are_invalid_requests(engine, spec, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        engine.add_request("bad", PROMPT, SamplingParams(max_tokens=4, structured=spec))
    assert engine.scheduler.find("bad") is None


def test_a_resumed_output_that_breaks_the_grammar_is_refused(engine):
    not_json = engine.tokenizer.encode("hello", add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="the output so far does not match"):
        engine.add_request("bad", PROMPT + not_json, SamplingParams(
            max_tokens=4, structured=StructuredOutput("json_object", ""), num_prior_output_tokens=len(not_json)))
