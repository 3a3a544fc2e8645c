"""The Llama-family transformer forward over a paged KV cache.

One class serves Llama, Mistral, Qwen2 (QKV bias), Qwen3 (QK-norm) and SmolLM2:
they differ only in flags of `ModelConfig`. The forward takes a flattened batch
(see `forward_batch.py`), writes each layer's new K/V into the paged pool, then
attends: decode rows as one batch (`paged_attention.py`: in place in the pool on
CPU), prefill chunks one segment at a time with PyTorch's fused
scaled-dot-product attention. Under tensor parallelism the weights are this
rank's shard and the two row-parallel outputs are all-reduced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitserve.services.engine.config import ModelConfig
from splitserve.services.engine.model.forward_batch import ForwardBatch, PrefillSegment
from splitserve.services.engine.kv_cache import KVCache
from splitserve.services.engine.model.linear import Linear
from splitserve.services.engine.model.paged_attention import GatherAttention, make_decode_attention
from splitserve.services.engine.model.rope import RotaryEmbedding
from splitserve.services.engine.loading.weights import LayerWeights, ModelWeights

LayerDone = Callable[[int], None]


@dataclass(slots=True)
class _LayerLinears:
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear

    @classmethod
    def of(cls, layer: LayerWeights) -> "_LayerLinears":
        return cls(Linear(layer.qkv, layer.qkv_bias), Linear(layer.o),
                   Linear(layer.gate_up), Linear(layer.down))


@dataclass(slots=True)
class _StepInputs:
    cos_sin: tuple[torch.Tensor, torch.Tensor]
    decode_mask: torch.Tensor | None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 like the reference implementation, then cast back.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class CausalLM:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, tp_size: int,
                 device: torch.device, dtype: torch.dtype, max_positions: int,
                 all_reduce: Callable[[torch.Tensor], None] | None = None,
                 attention_backend: str = "auto"):
        self.cfg = cfg
        self.w = weights
        self.num_heads = cfg.num_heads // tp_size
        self.num_kv_heads = cfg.num_kv_heads // tp_size
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions, device, dtype)
        self.all_reduce = all_reduce
        self.scale = cfg.head_dim ** -0.5
        self.linears = [_LayerLinears.of(layer) for layer in weights.layers]
        self.decode_attention = make_decode_attention(attention_backend, device, self.num_heads,
                                                      self.num_kv_heads, self.head_dim, self.scale,
                                                      cfg.sliding_window)
        self.lm_head = Linear(weights.lm_head)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache,
                layer_done: LayerDone | None = None) -> torch.Tensor:
        """Run all layers; returns the final hidden states of `batch.sample_indices` (normed)."""
        kv.copy_blocks(batch.block_copies)   # before any write: a fork's copy-on-write blocks
        x = F.embedding(batch.input_ids, self.w.embed)
        # Per-step inputs shared by every layer: computed once here, not per layer.
        step = _StepInputs(self.rotary.lookup(batch.positions), self._decode_mask(batch, kv))
        for i, layer in enumerate(self.w.layers):
            lin = self.linears[i]
            x = x + self._attention(i, layer, lin, rms_norm(x, layer.input_norm, self.cfg.rms_norm_eps),
                                    batch, kv, step)
            if layer_done is not None:
                layer_done(i)
            x = x + self._mlp(lin, rms_norm(x, layer.post_norm, self.cfg.rms_norm_eps))
        x = x.index_select(0, batch.sample_indices)
        return rms_norm(x, self.w.final_norm, self.cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def _mlp(self, lin: _LayerLinears, x: torch.Tensor) -> torch.Tensor:
        gate, up = lin.gate_up(x).chunk(2, dim=-1)
        out = lin.down(F.silu(gate) * up)
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out

    def _decode_mask(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor | None:
        """The gather path's padding mask, built once per step for every layer."""
        if not batch.num_decode or not isinstance(self.decode_attention, GatherAttention):
            return None
        return self.decode_attention.mask(batch.decode_block_tables, batch.decode_context_lens, kv.block_size)

    def _attention(self, i: int, layer: LayerWeights, lin: _LayerLinears, x: torch.Tensor,
                   batch: ForwardBatch, kv: KVCache, step: "_StepInputs") -> torch.Tensor:
        t = x.shape[0]
        qkv = lin.qkv(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, self.cfg.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, self.cfg.rms_norm_eps)
        q, k = self.rotary.apply(q, k, step.cos_sin)
        kv.write(i, batch.slot_mapping, k, v)

        out = torch.empty_like(q)
        d = batch.num_decode
        if d:
            out[:d] = self._decode_attention(i, q[:d], batch, kv, step.decode_mask)
        for seg in batch.prefills:
            rows = slice(seg.query_start, seg.query_start + seg.query_len)
            out[rows] = self._prefill_attention(i, q[rows], k[rows], v[rows], seg, kv)
        o = lin.o(out.view(t, self.q_size))
        if self.all_reduce is not None:
            self.all_reduce(o)
        return o

    def _decode_attention(self, i: int, q: torch.Tensor, batch: ForwardBatch, kv: KVCache,
                          mask: torch.Tensor | None) -> torch.Tensor:
        """q: [D, heads, d]; each row attends to its own cached context."""
        return self.decode_attention(i, q, kv, batch.decode_block_tables, batch.decode_context_lens, mask)

    def _prefill_attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           seg: PrefillSegment, kv: KVCache) -> torch.Tensor:
        """q: [n, heads, d] for positions context_len-n .. context_len-1."""
        n = seg.query_len
        window = self.cfg.sliding_window
        if seg.context_len == n:
            keys, values = k.transpose(0, 1), v.transpose(0, 1)      # no cached prefix
        else:
            keys, values = kv.gather(i, seg.block_ids.unsqueeze(0))
            keys, values = keys[0, :, :seg.context_len], values[0, :, :seg.context_len]
        # 4-D inputs: with 3-D ones PyTorch's CPU SDPA falls back to the slow math kernel.
        qh, keys, values = q.transpose(0, 1)[None], keys[None], values[None]
        if seg.context_len == n and not (window and n > window):
            out = F.scaled_dot_product_attention(qh, keys, values, is_causal=True,
                                                 scale=self.scale, enable_gqa=True)
        else:
            q_pos = torch.arange(seg.context_len - n, seg.context_len, device=q.device)[:, None]
            key_pos = torch.arange(seg.context_len, device=q.device)[None, :]
            mask = key_pos <= q_pos
            if window:
                mask &= key_pos > q_pos - window
            out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask,
                                                 scale=self.scale, enable_gqa=True)
        return out[0].transpose(0, 1)
