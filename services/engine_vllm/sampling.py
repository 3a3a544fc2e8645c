"""splitserve's per-request `SamplingParams` as vLLM's: a pure mapping, testable without vLLM.

`vllm_sampling_kwargs` returns the keyword arguments of `vllm.SamplingParams` for one request
(engine.py adds the output kind and builds it). Token ids in, token ids out: stop strings and
`include_stop_str_in_output` stay in splitserve's frontend, which aborts the request when one
matches, so they are not passed, and vLLM does not detokenize. bad_words arrive as token
sequences (the frontend owns the tokenizer), which is what vLLM keeps after its own
`update_from_tokenizer`: `bad_words_token_ids` carries them past it.

What vLLM cannot honour is refused here with an `InvalidRequestError` naming the field (an
HTTP 400), never silently dropped. All of it comes from request migration
(services/frontend/migration.py), which continues a request on another worker with the tokens
generated so far appended to the prompt:
- `num_prior_draws` > 0 on a seeded sampled request: vLLM's seeded generator cannot skip the
  draws made elsewhere, so the continuation would not be the stream the seed promises;
- `num_prior_output_tokens` > 0 with presence or frequency penalties: vLLM counts only the
  tokens it generated itself as output (repetition_penalty counts prompt and output alike, so
  it is fine);
- `num_prior_output_tokens` > 0 with structured output: vLLM's grammar starts at the first
  generated token and cannot be advanced over tokens it did not generate.
"""

from __future__ import annotations

import json
from typing import Any

from splitserve.errors import InvalidRequestError
from splitserve.services.worker_protocol.sampling_params import SamplingParams, StructuredOutput


def check_supported(params: SamplingParams) -> None:
    """Raise InvalidRequestError for what vLLM's engine cannot honour (see the module docstring)."""
    if params.num_prior_draws and params.seed is not None and not params.greedy:
        raise InvalidRequestError(
            f"num_prior_draws={params.num_prior_draws} is not supported by the vLLM engine: its seeded "
            f"generator cannot skip draws made on another worker (parameter=num_prior_draws, "
            f"value={params.num_prior_draws})")
    if params.num_prior_output_tokens and (params.presence_penalty or params.frequency_penalty):
        raise InvalidRequestError(
            f"num_prior_output_tokens={params.num_prior_output_tokens} with presence_penalty or "
            f"frequency_penalty is not supported by the vLLM engine: it counts only its own tokens as "
            f"output (parameter=num_prior_output_tokens, value={params.num_prior_output_tokens})")
    if params.num_prior_output_tokens and params.structured is not None:
        raise InvalidRequestError(
            f"num_prior_output_tokens={params.num_prior_output_tokens} with structured output is not "
            f"supported by the vLLM engine: its grammar cannot start mid-output "
            f"(parameter=num_prior_output_tokens, value={params.num_prior_output_tokens})")


def structured_kwargs(structured: StructuredOutput) -> dict[str, Any]:
    """The keyword arguments of vLLM's `StructuredOutputsParams` for one grammar."""
    kind, spec = structured.kind, structured.spec
    if kind == "json_schema":
        return {"json": spec}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "choice":
        try:
            choices = json.loads(spec)
        except ValueError:
            raise InvalidRequestError(f"structured choice must be a JSON list of strings, got {spec!r}") from None
        return {"choice": choices}
    if kind in ("regex", "grammar", "structural_tag"):
        return {kind: spec}
    raise InvalidRequestError(f"structured output kind {kind!r} is not supported by the vLLM engine")


def vllm_sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """`vllm.SamplingParams(**kwargs)` for `params` (validated; raises InvalidRequestError for what
    vLLM cannot honour). `structured_outputs` holds `structured_kwargs` (engine.py wraps it in
    vLLM's class) and `bad_words_token_ids` the token sequences (set after construction)."""
    params.validate()
    check_supported(params)
    kwargs: dict[str, Any] = {
        "n": 1,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,                # 0 disables in both
        "min_p": params.min_p,
        "seed": params.seed,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "min_tokens": params.min_tokens,
        "logprobs": params.logprobs,
        "prompt_logprobs": params.prompt_logprobs,
        "logit_bias": dict(params.logit_bias) or None,
        "allowed_token_ids": list(params.allowed_token_ids) or None,
        "logprob_token_ids": list(params.logprob_token_ids) or None,
        "detokenize": False,                  # text is the frontend's work
        "skip_special_tokens": False,
    }
    if params.structured is not None:
        kwargs["structured_outputs"] = structured_kwargs(params.structured)
    if params.bad_words:
        kwargs["bad_words_token_ids"] = [list(word) for word in params.bad_words]
    return kwargs
