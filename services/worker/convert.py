"""Conversions between the engine's dataclasses and the splitserve.v1 messages.

Kept in one place so the worker and the frontend agree on every field. The
wire's zero values mean "unset" where the engine's default differs
(top_p 0 -> 1.0).
"""

from __future__ import annotations

from splitserve.proto.v1 import common_pb2, worker_pb2
from splitserve.services.engine.engine import RequestOutput
from splitserve.services.engine.kv_events import AllCleared, BlockRemoved, BlockStored, KVEvent
from splitserve.services.engine.sampler import SampledToken
from splitserve.services.wire.sampling_params import SamplingParams
from splitserve.services.engine.sequence import FinishReason

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
        num_prior_draws=p.num_prior_draws)
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


def params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Validated engine parameters; raises InvalidRequestError."""
    params = SamplingParams(
        max_tokens=msg.max_tokens, temperature=msg.temperature, top_k=msg.top_k,
        top_p=msg.top_p or 1.0, min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        include_stop_str_in_output=msg.include_stop_str_in_output, num_prior_draws=msg.num_prior_draws)
    params.validate()
    return params


def logprob_to_proto(token: SampledToken) -> common_pb2.TokenLogprob:
    top = sorted((token.top_logprobs or {}).items(), key=lambda kv: -kv[1])
    return common_pb2.TokenLogprob(
        token_id=token.token_id, logprob=token.logprob or 0.0,
        top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top])


def encode_first_token(token: SampledToken) -> bytes:
    """The payload of a transfer's completion notification: the prefill's first token."""
    msg = worker_pb2.FirstToken(token_id=token.token_id)
    if token.logprob is not None:
        msg.logprob.CopyFrom(logprob_to_proto(token))
    return msg.SerializeToString()


def decode_first_token(payload: bytes) -> SampledToken:
    msg = worker_pb2.FirstToken.FromString(payload)
    if not msg.HasField("logprob"):
        return SampledToken(msg.token_id)
    return SampledToken(msg.token_id, msg.logprob.logprob, {t.token_id: t.logprob for t in msg.logprob.top})


def output_to_proto(out: RequestOutput, prefilled_remotely: bool = False) -> worker_pb2.TokenGenerateResponse:
    return worker_pb2.TokenGenerateResponse(
        token_ids=out.new_token_ids, logprobs=[logprob_to_proto(t) for t in out.logprobs],
        finished=out.finished, finish_reason=finish_reason_to_proto(out.finish_reason),
        num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
        num_output_tokens=out.num_output_tokens, prefilled_remotely=prefilled_remotely)


def event_to_proto(event: KVEvent) -> worker_pb2.KvEvent:
    if isinstance(event, BlockStored):
        stored = worker_pb2.BlockStored(block_hashes=list(event.block_hashes),
                                        token_ids=list(event.token_ids), tier=event.tier)
        if event.parent_hash is not None:
            stored.parent_hash = event.parent_hash
        return worker_pb2.KvEvent(seq=event.seq, stored=stored)
    if isinstance(event, BlockRemoved):
        return worker_pb2.KvEvent(seq=event.seq, removed=worker_pb2.BlockRemoved(
            block_hashes=list(event.block_hashes), tier=event.tier))
    assert isinstance(event, AllCleared), event
    return worker_pb2.KvEvent(seq=event.seq, cleared=worker_pb2.AllCleared())
