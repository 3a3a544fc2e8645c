"""The tensors one model step consumes: flattened tokens plus attention metadata.

Tokens of every scheduled sequence are concatenated into one row of `T` tokens
so the dense layers run once for the whole batch. Attention is the only part
that needs sequence boundaries: single-token decode rows come first and are
attended as one padded batch; prefill chunks follow, one segment each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class PrefillSegment:
    """A chunk of `query_len` new tokens of one sequence, starting at `query_start` in the batch."""

    query_start: int
    query_len: int
    context_len: int             # tokens of this sequence in the KV cache after this step
    block_ids: torch.Tensor      # [num_blocks] long, the sequence's blocks covering context_len


@dataclass(slots=True, frozen=True)
class LayerReport:
    """A prefill-only sequence whose KV this step completes: after each layer, every rank
    reports `LayerReady(request_id, layer, first_block, block_ids, num_tokens)` to its
    KV connector, which pushes that rank's heads of those blocks (engine._layer_callback)."""

    request_id: str
    first_block: int
    block_ids: list[int]
    num_tokens: int


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor          # [T] long
    positions: torch.Tensor          # [T] long
    slot_mapping: torch.Tensor       # [T] long: block_id * block_size + offset, where each token's KV goes
    num_decode: int                  # the first num_decode tokens are single-token decode rows
    decode_block_tables: torch.Tensor   # [num_decode, max_blocks] long, padded with 0
    decode_context_lens: torch.Tensor   # [num_decode] long
    prefills: list[PrefillSegment]
    sample_indices: torch.Tensor     # [S] long: tokens whose logits are needed
    layer_reports: list[LayerReport] = field(default_factory=list)   # set for the other TP ranks
    # (source, destination) block copies to make before this step writes anything: the
    # copy-on-write of a forked prompt's last partial block (scheduler.fork); every rank
    # copies its own shard.
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device) -> "ForwardBatch":
        if self.input_ids.device == device:
            return self
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return ForwardBatch(
            input_ids=move(self.input_ids), positions=move(self.positions),
            slot_mapping=move(self.slot_mapping), num_decode=self.num_decode,
            decode_block_tables=move(self.decode_block_tables),
            decode_context_lens=move(self.decode_context_lens),
            prefills=[PrefillSegment(p.query_start, p.query_len, p.context_len, move(p.block_ids))
                      for p in self.prefills],
            sample_indices=move(self.sample_indices), layer_reports=self.layer_reports,
            block_copies=self.block_copies,
        )
