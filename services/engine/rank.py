"""One tensor-parallel rank's model shard and KV tensor, built the same way on every rank.

Rank 0 (LLMEngine) and ranks 1..N-1 (parallel/tensor_parallel.py, each in its own
process) call `build_rank`; it sits in a module of its own so that neither of them
imports the other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from splitserve.services.engine.config import EngineConfig, ModelConfig
from splitserve.services.engine.kv_cache import KVCache
from splitserve.checkpoints.checkpoint import Checkpoint
from splitserve.services.engine.loading.smollm2 import open_model
from splitserve.services.engine.loading.weights import ShardSpec, load_weights
from splitserve.services.engine.model.causal_lm import CausalLM


def build_rank(config: EngineConfig, rank: int, ckpt: Checkpoint | None = None
               ) -> tuple[CausalLM, KVCache]:
    """Load this rank's shard and allocate its KV tensor (config.num_kv_blocks must be set)."""
    ckpt = ckpt or open_model(config.model)
    model_cfg = ModelConfig.from_hf(ckpt.config, ckpt.generation_config)
    world = config.tensor_parallel_size
    device, dtype = torch.device(config.device), config.torch_dtype()
    weights = load_weights(ckpt, model_cfg, ShardSpec(rank, world), dtype, device)
    max_positions = max(model_cfg.max_position_embeddings, config.max_model_len or 0)
    model = CausalLM(model_cfg, weights, world, device, dtype, max_positions,
                     all_reduce=dist.all_reduce if world > 1 else None,
                     attention_backend=config.attention_backend)
    kv = KVCache(model_cfg.num_layers, config.num_kv_blocks, config.block_size,
                 model_cfg.num_kv_heads // world, model_cfg.head_dim, dtype, device)
    return model, kv
