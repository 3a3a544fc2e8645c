"""Conversions of the engine's own types to the splitserve.v1 messages: a step's output, a
sampled token's log-probabilities, KV events.

The contract's conversions (sampling parameters, finish reasons) live in
services/worker_protocol/proto_conversion.py, which the frontend imports too; these need the
engine's types, so they stay on the worker's side.
"""

from __future__ import annotations

from splitserve.proto.v1 import common_pb2, worker_pb2
from splitserve.services.engine_api.kv_events import AllCleared, BlockRemoved, BlockStored, KVEvent
from splitserve.services.worker_protocol.proto_conversion import finish_reason_to_proto
from splitserve.services.worker_protocol.outputs import RequestOutput, SampledToken


def logprob_to_proto(token: SampledToken) -> common_pb2.TokenLogprob:
    # The engine's order: most likely first (top-n), or logprob_token_ids as the request named them.
    top = (token.top_logprobs or {}).items()
    return common_pb2.TokenLogprob(
        token_id=token.token_id, logprob=token.logprob or 0.0, rank=token.rank or 0,
        top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top])


def logprob_from_proto(msg: common_pb2.TokenLogprob) -> SampledToken:
    return SampledToken(msg.token_id, msg.logprob, {t.token_id: t.logprob for t in msg.top}, msg.rank or None)


# A live migration's completion payload: the KV of all but the last token arrived, and no first
# token comes with it (the destination computes that token and samples the next itself).
MIGRATED_KV = b"SKM1"


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


def output_to_proto(out: RequestOutput, prefilled_remotely: bool = False,
                    choice: int = 0, kv_moved: bool = False) -> worker_pb2.TokenGenerateResponse:
    return worker_pb2.TokenGenerateResponse(
        token_ids=out.new_token_ids, logprobs=[logprob_to_proto(t) for t in out.logprobs],
        finished=out.finished, finish_reason=finish_reason_to_proto(out.finish_reason),
        num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
        num_output_tokens=out.num_output_tokens, prefilled_remotely=prefilled_remotely, choice=choice,
        prompt_logprobs=[logprob_to_proto(t) for t in out.prompt_logprobs or []], kv_moved=kv_moved)


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
