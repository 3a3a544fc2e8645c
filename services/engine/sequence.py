"""One request's state inside the engine: tokens, blocks, progress, outcome."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from splitserve.services.engine.logits_controls import TokenCounts
from splitserve.services.worker_protocol.outputs import FinishReason, SampledToken
from splitserve.kvtransfer.sender_receiver import LayerCallback
from splitserve.services.worker_protocol.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    REMOTE_PREFILL = "remote_prefill"   # blocks reserved, another worker is filling them
    FINISHED = "finished"


class TransferUse(enum.Enum):
    """How a KV transfer uses a sequence's blocks, so that finishing it leaves them to the
    transfer (scheduler.transfer_owned) until the transfer says it is done."""

    SEND = "send"          # prefill-only: a connector reads the prefilled blocks to send them
    RECEIVE = "receive"    # fenced reservation: a prefill worker may write the granted blocks


@dataclass(slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int                                   # admission order, for FCFS and preemption
    prefill_only: bool = False
    on_layer_done: LayerCallback | None = None     # prefill-only: (request_id, layer, block_ids)
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0                     # leading blocks registered in the prefix cache
    num_computed_tokens: int = 0
    num_prefix_hit_tokens: int = 0                 # tokens served from the prefix cache at admission
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    transfer: TransferUse | None = None            # a KV transfer uses the blocks (asked at finish)
    grammar: Any = None                            # structured output: its grammar.GrammarState
    # Sibling samples of the same prompt (n > 1): not queued anywhere until this sequence's
    # prefill completes, then each forks from its blocks (scheduler.fork) and samples its own
    # first token from the same logits.
    forks: list["Sequence"] = field(default_factory=list)
    # The penalties' token counts (logits_controls.TokenCounts), built when first needed and
    # then kept by the engine as tokens are accepted; they survive a preemption (same tokens).
    token_counts: TokenCounts | None = None
    # params.prompt_logprobs: the entries of prompt tokens 1.. computed so far (prefill chunks
    # append in order; a recompute after preemption finds them there), sent with the first token.
    prompt_logprobs: list[SampledToken] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_pending_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs asked and not all computed: its prefill must run without prefix-cache
        reads (cached blocks have no logits; vLLM recomputes such requests too)."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
