"""Conversions of the contract's dataclasses to and from the splitserve.v1 messages.

Both sides import these, so the worker and the frontend agree on every field.
The wire's zero values mean "unset" where the engine's default differs
(top_p 0 -> 1.0, repetition_penalty 0 -> 1.0). Conversions of engine-only types (a step's output, KV events)
stay with the worker (services/worker/output_messages.py).

`stop` and `include_stop_str_in_output` still travel in both directions (old
frontends send them, and a decode worker forwards its parameters to a prefill
worker unchanged), but workers ignore them: stop strings are text, and text is
the frontend's work. The frontend sends neither (migration.Progress.worker_request).
"""

from __future__ import annotations

from splitserve.proto.v1 import common_pb2
from splitserve.services.worker_protocol.outputs import FinishReason
from splitserve.services.worker_protocol.sampling_params import SamplingParams, StructuredOutput

_FINISH_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.PREFILL_DONE: common_pb2.FINISH_REASON_PREFILL_DONE,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    return _FINISH_TO_PROTO[reason]


def finish_reason_from_proto(value: int) -> FinishReason | None:
    return _FINISH_FROM_PROTO.get(value)


def params_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
        min_p=p.min_p, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos, include_stop_str_in_output=p.include_stop_str_in_output,
        num_prior_draws=p.num_prior_draws, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
        logit_bias=[common_pb2.TokenBias(token_id=t, bias=b) for t, b in sorted(p.logit_bias.items())],
        min_tokens=p.min_tokens, num_prior_output_tokens=p.num_prior_output_tokens,
        allowed_token_ids=list(p.allowed_token_ids), logprob_token_ids=list(p.logprob_token_ids),
        bad_words=[common_pb2.TokenSequence(token_ids=w) for w in p.bad_words])
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.structured is not None:
        msg.structured.kind, msg.structured.spec = p.structured.kind, p.structured.spec
    return msg


def params_from_proto(msg: common_pb2.SamplingParams, cache_salt: str = "") -> SamplingParams:
    """Validated engine parameters; raises InvalidRequestError. `cache_salt` is the request's
    (it travels on TokenGenerateRequest / PrefillRequest, not in SamplingParams)."""
    params = SamplingParams(
        max_tokens=msg.max_tokens, temperature=msg.temperature, top_k=msg.top_k,
        top_p=msg.top_p or 1.0, min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None, logprob_token_ids=list(msg.logprob_token_ids),
        include_stop_str_in_output=msg.include_stop_str_in_output, num_prior_draws=msg.num_prior_draws,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0,
        logit_bias={b.token_id: b.bias for b in msg.logit_bias},
        min_tokens=msg.min_tokens, num_prior_output_tokens=msg.num_prior_output_tokens,
        structured=StructuredOutput(msg.structured.kind, msg.structured.spec) if msg.HasField("structured") else None,
        allowed_token_ids=list(msg.allowed_token_ids), bad_words=[list(w.token_ids) for w in msg.bad_words],
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None, cache_salt=cache_salt)
    params.validate()
    return params
