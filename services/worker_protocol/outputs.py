"""What a worker's engine produces for a request, as both sides of the wire read it.

`FinishReason` names how a request ended, `SampledToken` is one chosen token with
its log-probabilities, and `RequestOutput` is one step's output for one request.
They live here, outside the engine, so the frontend (and anything else that only
reads outputs) can import them without torch: the engine builds them, the
worker converts them to proto (services/worker/output_messages.py), the frontend reads
the proto back (services/worker_protocol/proto_conversion.py).

Outputs carry token ids only. Text is the frontend's work (services/text/):
the engine never detokenizes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.Enum):
    STOP = "stop"              # EOS or a stop token (engine), or a stop string (frontend)
    LENGTH = "length"          # max_tokens or the context limit
    ABORT = "abort"
    PREFILL_DONE = "prefill_done"   # prefill-only request handed its KV over


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
    rank: int | None = None            # 1: the most likely token (prompt logprobs compute it)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    logprobs: list[SampledToken] = field(default_factory=list)
    # With the first token only, when params.prompt_logprobs was set: one entry per prompt token
    # from the second on (the first has no logprob), the token's logprob and the top-n.
    prompt_logprobs: list[SampledToken] | None = None
    # A prefill-only request of a KV-handoff engine (engine_api/contract.py KVHandoffEngine), with
    # its PREFILL_DONE output: where the decode side's engine fetches the prompt's KV.
    kv_handoff: dict | None = None
