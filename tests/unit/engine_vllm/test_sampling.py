"""splitserve's SamplingParams as vLLM's keyword arguments (services/engine_vllm/sampling.py),
without vLLM: every field mapped or deliberately left to the frontend, and what vLLM cannot
honour refused naming the field. tests/integration/vllm/test_sampling_params.py builds the
result with vLLM's own class in the engine environment."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve.errors import InvalidRequestError
from splitserve.services.engine_vllm.sampling import structured_kwargs, vllm_sampling_kwargs
from splitserve.services.worker_protocol.sampling_params import SamplingParams, StructuredOutput

# Fields the mapping does not pass, and why: text is the frontend's (stop strings), the migration
# counters are checked (refused when vLLM cannot honour them), the salt goes with the prompt.
NOT_PASSED = {"stop", "include_stop_str_in_output", "num_prior_draws", "num_prior_output_tokens", "cache_salt"}


def test_every_field_is_mapped_or_accounted_for():
    params = SamplingParams(
        max_tokens=9, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=11, stop=["x"],
        stop_token_ids=[2, 3], ignore_eos=True, logprobs=3, logprob_token_ids=[4, 5], presence_penalty=0.1,
        frequency_penalty=0.2, repetition_penalty=1.1, logit_bias={7: -1.5}, min_tokens=2,
        structured=StructuredOutput("regex", "[a-z]+"), allowed_token_ids=[7, 8, 9], bad_words=[[1, 2], [6]],
        prompt_logprobs=1)
    kwargs = vllm_sampling_kwargs(params)
    assert kwargs == {
        "n": 1, "max_tokens": 9, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 11,
        "presence_penalty": 0.1, "frequency_penalty": 0.2, "repetition_penalty": 1.1, "stop_token_ids": [2, 3],
        "ignore_eos": True, "min_tokens": 2, "logprobs": 3, "prompt_logprobs": 1, "logit_bias": {7: -1.5},
        "allowed_token_ids": [7, 8, 9], "logprob_token_ids": [4, 5], "detokenize": False,
        "skip_special_tokens": False, "structured_outputs": {"regex": "[a-z]+"},
        "bad_words_token_ids": [[1, 2], [6]]}
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    passed = set(kwargs) | {"structured", "bad_words"}
    assert fields - passed == NOT_PASSED


def test_defaults_map_to_vllms_neutral_values():
    kwargs = vllm_sampling_kwargs(SamplingParams())
    assert kwargs["logit_bias"] is None and kwargs["allowed_token_ids"] is None
    assert kwargs["logprobs"] is None and kwargs["prompt_logprobs"] is None and kwargs["logprob_token_ids"] is None
    assert "structured_outputs" not in kwargs and "bad_words_token_ids" not in kwargs


@pytest.mark.parametrize("kind, spec, expected", [
    ("json_schema", '{"type": "object"}', {"json": '{"type": "object"}'}),
    ("json_object", "", {"json_object": True}),
    ("regex", "a+", {"regex": "a+"}),
    ("choice", '["yes", "no"]', {"choice": ["yes", "no"]}),
    ("grammar", 'root ::= "a"', {"grammar": 'root ::= "a"'}),
    ("structural_tag", '{"type": "structural_tag"}', {"structural_tag": '{"type": "structural_tag"}'}),
])
def test_structured_outputs_kinds(kind, spec, expected):
    assert structured_kwargs(StructuredOutput(kind, spec)) == expected


@pytest.mark.parametrize("params, named", [
    (SamplingParams(seed=1, temperature=0.5, num_prior_draws=4), "num_prior_draws"),
    (SamplingParams(frequency_penalty=0.3, num_prior_output_tokens=2), "num_prior_output_tokens"),
    (SamplingParams(presence_penalty=-0.3, num_prior_output_tokens=2), "num_prior_output_tokens"),
    (SamplingParams(structured=StructuredOutput("regex", "a+"), num_prior_output_tokens=1),
     "num_prior_output_tokens"),
])
def test_what_vllm_cannot_honour_is_refused_naming_the_field(params, named):
    with pytest.raises(InvalidRequestError, match=rf"parameter={named}\b"):
        vllm_sampling_kwargs(params)


@pytest.mark.parametrize("params", [
    SamplingParams(num_prior_draws=4),                               # greedy: no draws to replay
    SamplingParams(temperature=0.5, num_prior_draws=4),              # unseeded: any stream will do
    SamplingParams(repetition_penalty=1.2, num_prior_output_tokens=3),   # counts prompt and output alike
])
def test_what_a_migration_sends_and_vllm_can_honour_is_accepted(params):
    assert vllm_sampling_kwargs(params)["n"] == 1


def test_invalid_parameters_are_refused_before_vllm():
    with pytest.raises(InvalidRequestError, match="top_p"):
        vllm_sampling_kwargs(SamplingParams(top_p=0.0))
