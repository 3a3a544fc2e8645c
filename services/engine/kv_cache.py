"""The paged KV tensor of one worker (one TP rank).

Layout is layer-major, `[layers][2][blocks][block_size][kv_heads][head_dim]`, so
one layer's K (or V) blocks form one contiguous region that a KV connector can
register and send as that layer is computed. Which block belongs to
whom is `block_pool.BlockPool`'s business; this class only moves tensors.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tensor = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                                  dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def layer(self, layer: int) -> torch.Tensor:
        """[2, blocks, block_size, kv_heads, head_dim] view of one layer (K then V)."""
        return self.tensor[layer]

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V ([T, kv_heads, d]) at flat slots block_id * block_size + offset."""
        kv = self.tensor[layer]
        kv[0].view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
        kv[1].view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (K and V, every layer) from source to destination ids."""
        if copies:
            src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.tensor.device)
            dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.tensor.device)
            self.tensor.index_copy_(2, dst, self.tensor.index_select(2, src))

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block_tables [B, M] → keys, values [B, kv_heads, M * block_size, d]."""
        b, m = block_tables.shape
        kv = self.tensor[layer]
        keys = kv[0][block_tables].view(b, m * self.block_size, *kv.shape[-2:]).transpose(1, 2)
        values = kv[1][block_tables].view(b, m * self.block_size, *kv.shape[-2:]).transpose(1, 2)
        return keys, values
