"""Model and engine configuration.

`ModelConfig` is the engine's reading of a Hugging Face `config.json`: only the
fields the Llama family needs, validated once so the model code can trust them.
`EngineConfig` holds the knobs of one engine instance (device, dtype, KV pool
size, batching budgets, tensor parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitserve.errors import InvalidRequestError, UnsupportedModelError

# HF architecture name -> (family, has qkv bias, has qk-norm)
_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False, False),
    "MistralForCausalLM": ("mistral", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
}

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise InvalidRequestError(
            f"unknown dtype {name!r}; use one of float32, bfloat16, float16") from None


@dataclass(slots=True, frozen=True)
class RopeConfig:
    theta: float
    max_position: int = 4096
    rope_type: str = "default"          # default | linear | llama3 | yarn
    factor: float = 1.0
    original_max_position: int | None = None
    low_freq_factor: float = 1.0        # llama3
    high_freq_factor: float = 4.0       # llama3
    beta_fast: float = 32.0             # yarn
    beta_slow: float = 1.0              # yarn
    attention_factor: float | None = None  # yarn


@dataclass(slots=True, frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, config: dict, generation_config: dict | None = None) -> "ModelConfig":
        archs = config.get("architectures") or []
        arch = next((a for a in archs if a in _ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or config.get('model_type')!r}; "
                f"supported: {', '.join(sorted(_ARCHITECTURES))}")
        family, qkv_bias, qk_norm = _ARCHITECTURES[arch]
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            kv_heads = int(config.get("num_key_value_heads") or heads)
            head_dim = int(config.get("head_dim") or hidden // heads)
            layers = int(config["num_hidden_layers"])
            vocab = int(config["vocab_size"])
            inter = int(config["intermediate_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise UnsupportedModelError(f"config.json lacks a usable field: {exc}") from exc
        if heads % kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        if family == "qwen2":
            qkv_bias = bool(config.get("attention_bias", True))
        elif config.get("attention_bias"):
            qkv_bias = True
        sliding = config.get("sliding_window")
        if family == "qwen2" and not config.get("use_sliding_window", False):
            sliding = None
        gen = generation_config or {}
        eos = gen.get("eos_token_id", config.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            family=family, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
            num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(config),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias, qk_norm=qk_norm,
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )


def _parse_rope(config: dict) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (with rope_theta inside); older
    # configs have `rope_theta` plus an optional `rope_scaling` dict.
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        raise UnsupportedModelError(
            f"unsupported RoPE scaling {rope_type!r}; supported: default, linear, llama3, yarn")
    orig = params.get("original_max_position_embeddings")
    return RopeConfig(
        theta=theta, max_position=int(config.get("max_position_embeddings", 4096)),
        rope_type=rope_type, factor=float(params.get("factor", 1.0)),
        original_max_position=int(orig) if orig else None,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast", 32.0)),
        beta_slow=float(params.get("beta_slow", 1.0)),
        attention_factor=params.get("attention_factor"),
    )


@dataclass(slots=True)
class EngineConfig:
    """Knobs of one engine. Defaults suit a laptop CPU; the CLI exposes each."""

    model: str = "smollm2"
    device: str = "cpu"
    dtype: str = "auto"                  # auto: bf16 on CUDA, float32 on CPU
    block_size: int = 16
    num_kv_blocks: int | None = None     # None: sized from kv_cache_gib
    kv_cache_gib: float = 1.0
    max_num_batched_tokens: int = 2048   # per-step token budget (chunked prefill)
    max_num_seqs: int = 64
    max_model_len: int | None = None     # None: the model's max_position_embeddings
    max_logprobs: int = 20               # vLLM's --max-logprobs: most logprobs per token; -1: the vocabulary
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    seed: int = 0
    num_threads: int | None = None       # torch CPU threads; None leaves torch's default
    cpu_cores: tuple[int, ...] | None = None   # pin the ranks' threads to these cores (cpu_placement)
    cpu_yield: bool = False              # pinned ranks step with fewer threads while others use their cores (core_sharing)
    attention_backend: str = "auto"      # decode attention: auto | paged (in place, CPU) | gather
    extra_cache_key: str = ""            # mixed into block hashes (e.g. a LoRA id)
    weights_revision: str = ""           # names the weights in the fingerprint (else SPLITSERVE_WEIGHTS_REVISION, a digest)
    kv_host_gib: float = 0.0             # host-memory tier below the pool (kv_tiers/); 0: none
    kv_disk_gib: float = 0.0             # local-disk tier below the host tier; 0: none
    kv_disk_path: str | None = None      # its folder (needed with kv_disk_gib)
    dist_init_method: str | None = None  # set by the TP launcher
    tp_leader: str | None = None         # host:port of rank 0's rendezvous: ranks started on their own join it
    tp_join_timeout_s: float = 1800.0    # every rank must have joined and loaded by then
    model_name: str = field(default="", compare=False)

    def rank_threads(self, rank: int) -> tuple[tuple[int, ...] | None, int | None]:
        """(cores, torch threads) of one rank: its share of `cpu_cores`, one thread per core
        unless `num_threads` says otherwise."""
        if not self.cpu_cores:
            return None, self.num_threads
        from splitserve.services.engine.cpu_placement import rank_cores

        cores = rank_cores(self.cpu_cores, self.tensor_parallel_size, rank)
        return cores, self.num_threads or len(cores)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return parse_dtype(self.dtype)
