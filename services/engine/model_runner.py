"""Builds each step's `ForwardBatch` and runs the model on this process's shard.

The runner owns the model and the KV tensor of one rank. On rank 0 it turns
the scheduler's decision into tensors; under tensor parallelism it first sends
that batch to the other ranks (see `tensor_parallel.py`) so all run the same step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from splitserve.services.engine.model.forward_batch import ForwardBatch, LayerReport, PrefillSegment
from splitserve.services.engine.kv_cache import KVCache
from splitserve.services.engine.model.causal_lm import CausalLM
from splitserve.services.engine.scheduler import ScheduledChunk


def build_forward_batch(chunks: list[ScheduledChunk], block_size: int,
                        device: torch.device) -> ForwardBatch:
    """Chunks must list single-token chunks first (the scheduler sorts them so)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_indices: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillSegment] = []
    for chunk in chunks:
        seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
        query_start = len(input_ids)
        input_ids.extend(_token_range(seq.prompt_token_ids, seq.output_token_ids, start, start + n))
        positions.extend(range(start, start + n))
        blocks = seq.block_ids
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        num_blocks = -(-(start + n) // block_size)
        if n == 1:
            decode_tables.append(blocks[:num_blocks])
            decode_lens.append(start + 1)
        else:
            prefills.append(PrefillSegment(query_start, n, start + n,
                                           torch.tensor(blocks[:num_blocks], dtype=torch.long)))
        if chunk.completes:
            sample_indices.append(query_start + n - 1)
    width = max((len(t) for t in decode_tables), default=0)
    table = torch.zeros(len(decode_tables), width, dtype=torch.long)
    for row, t in enumerate(decode_tables):
        table[row, :len(t)] = torch.tensor(t, dtype=torch.long)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    batch = ForwardBatch(
        input_ids=as_long(input_ids), positions=as_long(positions), slot_mapping=as_long(slots),
        num_decode=len(decode_tables), decode_block_tables=table,
        decode_context_lens=as_long(decode_lens), prefills=prefills,
        sample_indices=as_long(sample_indices),
    )
    return batch.to(device)


def _token_range(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    p = len(prompt)
    if end <= p:
        return prompt[start:end]
    if start >= p:
        return output[start - p:end - p]
    return prompt[start:] + output[:end - p]


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache, device: torch.device,
                 broadcast: Callable[[ForwardBatch], None] | None = None):
        self.model = model
        self.kv = kv
        self.device = device
        self.broadcast = broadcast

    def execute(self, chunks: list[ScheduledChunk], layer_done: Callable[[int], None] | None = None,
                layer_reports: list[LayerReport] | None = None,
                block_copies: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """Run one step; returns float32 logits for the chunks that complete their tokens.

        `layer_reports` go to the other TP ranks with the batch (their layer hooks push
        their share of those sequences' KV); `layer_done` is this rank's callback."""
        batch = build_forward_batch(chunks, self.kv.block_size, self.device)
        batch.block_copies = block_copies or []
        if self.broadcast is not None:
            batch.layer_reports = layer_reports or []
            self.broadcast(batch)
        hidden = self.model.forward(batch, self.kv, layer_done)
        return self.model.logits(hidden)
