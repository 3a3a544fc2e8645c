"""Turn a checkpoint's tensor stream into the engine's fused, sharded weights.

The engine fuses q/k/v into one matrix and gate/up into another (one matmul
each instead of three and two) and, under tensor parallelism, keeps only this
rank's Megatron shard: q/k/v heads and gate/up rows are split column-parallel,
o and down are split row-parallel (on their input dimension).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.errors import ModelLoadError, UnsupportedModelError

from splitserve.checkpoints.checkpoint import Checkpoint
from splitserve.services.engine.config import ModelConfig


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor               # [(q_heads + 2 * kv_heads) * head_dim, hidden] (this rank's heads)
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor                 # [hidden, q_heads * head_dim]
    post_norm: torch.Tensor
    gate_up: torch.Tensor           # [2 * intermediate / tp, hidden]
    down: torch.Tensor              # [hidden, intermediate / tp]


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor


@dataclass(slots=True, frozen=True)
class ShardSpec:
    rank: int = 0
    world_size: int = 1

    def check(self, cfg: ModelConfig) -> None:
        n = self.world_size
        for what, count in (("num_attention_heads", cfg.num_heads),
                            ("num_key_value_heads", cfg.num_kv_heads),
                            ("intermediate_size", cfg.intermediate_size)):
            if count % n:
                raise UnsupportedModelError(
                    f"tensor parallel size {n} does not divide {what}={count}; "
                    f"choose a size that divides {cfg.num_kv_heads} (the KV heads)")

    def rows(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        if self.world_size == 1:
            return t
        size = t.shape[dim] // self.world_size
        return t.narrow(dim, self.rank * size, size)


def load_weights(ckpt: Checkpoint, cfg: ModelConfig, shard: ShardSpec,
                 dtype: torch.dtype, device: torch.device) -> ModelWeights:
    shard.check(cfg)
    raw = _collect(ckpt, cfg, shard, dtype)
    convert = lambda t: t.to(device=device, dtype=dtype).contiguous()  # noqa: E731
    layers = [_build_layer(raw, cfg, i, shard.world_size, convert) for i in range(cfg.num_layers)]
    embed = _take(raw, "model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
    if "lm_head.weight" in raw and not cfg.tie_word_embeddings:
        lm_head = _take(raw, "lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
    else:
        lm_head = embed
    embed_dev = convert(embed)
    return ModelWeights(
        embed=embed_dev, layers=layers,
        final_norm=convert(_take(raw, "model.norm.weight", (cfg.hidden_size,))),
        lm_head=embed_dev if lm_head is embed else convert(lm_head),
    )


def _collect(ckpt: Checkpoint, cfg: ModelConfig, shard: ShardSpec,
             dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Read every tensor once, keeping only this rank's shard, in the target dtype."""
    raw: dict[str, torch.Tensor] = {}
    for name, tensor in ckpt.tensors():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        raw[name] = _shard_tensor(name, tensor, shard).to(dtype)
    return raw


def _shard_tensor(name: str, t: torch.Tensor, shard: ShardSpec) -> torch.Tensor:
    if shard.world_size == 1:
        return t
    column_parallel = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    if any(f".{part}." in name for part in column_parallel):
        return shard.rows(t, 0)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return shard.rows(t, 1)
    return t


def _take(raw: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    try:
        t = raw[name]
    except KeyError:
        raise ModelLoadError(f"checkpoint is missing tensor {name!r}") from None
    if tuple(t.shape) != shape:
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
    return t


def _build_layer(raw: dict[str, torch.Tensor], cfg: ModelConfig, i: int, tp: int,
                 convert) -> LayerWeights:
    p = f"model.layers.{i}."
    h, d = cfg.hidden_size, cfg.head_dim
    nq, nkv, inter = cfg.num_heads // tp, cfg.num_kv_heads // tp, cfg.intermediate_size // tp
    q = _take(raw, p + "self_attn.q_proj.weight", (nq * d, h))
    k = _take(raw, p + "self_attn.k_proj.weight", (nkv * d, h))
    v = _take(raw, p + "self_attn.v_proj.weight", (nkv * d, h))
    bias = None
    if cfg.qkv_bias:
        bias = convert(torch.cat([
            _take(raw, p + "self_attn.q_proj.bias", (nq * d,)),
            _take(raw, p + "self_attn.k_proj.bias", (nkv * d,)),
            _take(raw, p + "self_attn.v_proj.bias", (nkv * d,))]))
    q_norm = k_norm = None
    if cfg.qk_norm:
        q_norm = convert(_take(raw, p + "self_attn.q_norm.weight", (d,)))
        k_norm = convert(_take(raw, p + "self_attn.k_norm.weight", (d,)))
    gate = _take(raw, p + "mlp.gate_proj.weight", (inter, h))
    up = _take(raw, p + "mlp.up_proj.weight", (inter, h))
    return LayerWeights(
        input_norm=convert(_take(raw, p + "input_layernorm.weight", (h,))),
        qkv=convert(torch.cat([q, k, v])), qkv_bias=bias, q_norm=q_norm, k_norm=k_norm,
        o=convert(_take(raw, p + "self_attn.o_proj.weight", (h, nq * d))),
        post_norm=convert(_take(raw, p + "post_attention_layernorm.weight", (h,))),
        gate_up=convert(torch.cat([gate, up])),
        down=convert(_take(raw, p + "mlp.down_proj.weight", (h, inter))),
    )
