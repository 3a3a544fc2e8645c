"""Load a llama.cpp GGUF file into a `Checkpoint`.

A GGUF carries everything in one file: hyperparameters and the tokenizer as
metadata under llama.cpp's key names, and tensors under llama.cpp's names, in
ggml dimension order, often block-quantized. This module translates all three
into what a Hugging Face folder would hold:

- config: an HF `config.json` dict for the architectures the engine runs
  (`llama` — also SmolLM and Mistral —, `qwen2`, `qwen3`);
- tensors: dequantized with `gguf.quants` one at a time, reshaped to the HF
  shape, renamed, and for `llama` with q/k un-permuted (llama.cpp's converter
  interleaves the two RoPE halves of each head; HF keeps them split);
- tokenizer: rebuilt as `tokenizers` JSON (see `gguf_tokenizer.py`).

The file is memory-mapped once; `tensors()` dequantizes lazily on each pass.
Every check that needs no dequantization (names, types, truncation) runs at
load time, so a bad file fails before the engine starts building a model.
torch is imported by the first tensor, not here: the frontend opens a GGUF for
its tokenizer only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader, ReaderField, ReaderTensor
from gguf.quants import dequantize

from splitserve.errors import ModelLoadError, UnsupportedModelError
from splitserve.checkpoints.checkpoint import Checkpoint
from splitserve.checkpoints.gguf_tokenizer import build_tokenizer

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# GGUF architecture -> (HF class, q/k permuted by llama.cpp's converter)
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_READ_ERRORS = (ValueError, IndexError, KeyError, OSError, EOFError, UnicodeDecodeError)


def load_gguf(path: Path) -> Checkpoint:
    """Read a GGUF file; raises ModelLoadError (UnsupportedModelError for a valid
    file this engine cannot run) with the file named in the message."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    try:
        reader = GGUFReader(path)
    except _READ_ERRORS as exc:
        raise ModelLoadError(f"corrupt GGUF file {path}: {exc}; the file is truncated or not GGUF, "
                             "download it again") from exc
    meta = _Metadata(reader, path)
    arch = meta.require("general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} is not supported; "
                                    f"supported: {', '.join(_ARCHITECTURES)}")
    by_name = {t.name: t for t in reader.tensors}
    config = _build_hf_config(meta, arch, by_name)
    plan = _tensor_plan(reader.tensors, config, permuted=_ARCHITECTURES[arch][1], path=path)
    tokenizer_json, tokenizer_config, generation_config = build_tokenizer(meta)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in generation_config:
            config[key] = _first(generation_config[key])

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for tensor, hf_name, num_heads in plan:
            yield hf_name, _to_torch(tensor, num_heads)

    logger.info("loaded GGUF %s: arch %s, %d tensors", path, arch, len(plan))
    return Checkpoint(name=path.stem, config=config, tensors=tensors, tokenizer_json=tokenizer_json,
                      tokenizer_config=tokenizer_config, generation_config=generation_config,
                      source=str(path), num_tensors=len(plan))


class _Metadata:
    """GGUF key/value fields as plain Python values."""

    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self._fields: dict[str, ReaderField] = reader.fields
        self.path = path

    def get(self, key: str, default=None):
        field = self._fields.get(key)
        if field is None or not field.types:
            return default
        try:
            value = field.contents()
        except _READ_ERRORS as exc:
            raise ModelLoadError(f"corrupt GGUF file {self.path}: metadata {key!r}: {exc}") from exc
        return float(f"{value:.7g}") if isinstance(value, float) else value  # float32 -> 1e-05, not 9.99e-06

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"GGUF file {self.path} lacks metadata {key!r}; it is incomplete or "
                                 "was written by an unsupported converter")
        return value

    def strings(self, key: str) -> list[str] | None:
        """A string array, decoded leniently (some vocabularies hold partial UTF-8)."""
        field = self._fields.get(key)
        if field is None:
            return None
        return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]


# --- config -----------------------------------------------------------------


def _build_hf_config(meta: _Metadata, arch: str, tensors: dict[str, ReaderTensor]) -> dict:
    """The HF config.json for a GGUF's hyperparameters."""
    hidden = int(meta.require(f"{arch}.embedding_length"))
    heads = int(meta.require(f"{arch}.attention.head_count"))
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"GGUF file {meta.path} has no token_embd.weight tensor")
    config = {
        "architectures": [_ARCHITECTURES[arch][0]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
        "vocab_size": int(embed.shape[1]),  # ggml order: [hidden, vocab]
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": False,
    }
    rope_scaling = _rope_scaling(meta, arch, config, tensors.get("rope_freqs.weight"))
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(meta: _Metadata, arch: str, config: dict, rope_freqs: ReaderTensor | None) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind is None and meta.get(f"{arch}.rope.scale_linear") is not None:
        kind, factor = "linear", meta.get(f"{arch}.rope.scale_linear")
    if rope_freqs is not None:
        return _llama3_rope_from_freqs(np.asarray(rope_freqs.data, dtype=np.float64), config, meta.path)
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise UnsupportedModelError(f"{meta.path}: RoPE scaling type {kind!r} is not supported")
    scaling = {"rope_type": kind, "type": kind, "factor": float(factor or 1.0)}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        value = meta.get(f"{arch}.rope.scaling.{gguf_key}")
        if value is not None:
            scaling[hf_key] = value
    return scaling


def _llama3_rope_from_freqs(divisors: np.ndarray, config: dict, path: Path) -> dict:
    """Recover HF's `llama3` rope_scaling from llama.cpp's `rope_freqs` tensor.

    llama.cpp stores the per-frequency divisor d_i = 1 / ((1 - s_i) / factor + s_i),
    where s_i = old_len / wavelen_i / (high - low) - low / (high - low) is linear
    in 1 / wavelen_i. The divisors therefore give `factor` (their maximum) and,
    from the blended band, the line's slope and intercept; old_len, low and high
    are fixed only up to a common scale, which leaves inv_freq unchanged, so
    old_len is pinned to 8192 (the value llama.cpp itself assumes).
    """
    factor = float(divisors.max())
    theta, dim = config["rope_theta"], config["head_dim"]
    inv_wavelen = (1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)) / (2 * math.pi)
    band = (divisors > 1 + 1e-4) & (divisors < factor - 1e-4)
    if len(divisors) != dim // 2 or factor <= 1 or band.sum() < 2:
        raise UnsupportedModelError(f"{path}: cannot recover the llama3 RoPE scaling from its rope_freqs "
                                    "tensor; load the original Hugging Face folder instead")
    smooth = (1 / divisors[band] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(inv_wavelen[band], smooth, 1)
    old_len = 8192.0
    span = old_len / slope  # high - low
    low = -intercept * span
    return {"rope_type": "llama3", "factor": round(factor, 6), "low_freq_factor": round(low, 6),
            "high_freq_factor": round(low + span, 6), "original_max_position_embeddings": int(old_len)}


# --- tensors ----------------------------------------------------------------


def _hf_name(gguf_name: str) -> str | None:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    return None


def _tensor_plan(tensors: list[ReaderTensor], config: dict, permuted: bool,
                 path: Path) -> list[tuple[ReaderTensor, str, int]]:
    """(tensor, hf name, heads to un-permute or 0) for every weight, checked up front."""
    plan = []
    for tensor in tensors:
        if tensor.name == "rope_freqs.weight":
            continue  # folded into config["rope_scaling"]
        hf_name = _hf_name(tensor.name)
        if hf_name is None:
            raise UnsupportedModelError(f"{path}: unexpected tensor {tensor.name!r} for a "
                                        f"{config['model_type']} model")
        _check_dtype(tensor, path)
        num_heads = 0
        if permuted and ".self_attn.q_proj." in hf_name:
            num_heads = config["num_attention_heads"]
        elif permuted and ".self_attn.k_proj." in hf_name:
            num_heads = config["num_key_value_heads"]
        plan.append((tensor, hf_name, num_heads))
    return plan


def _check_dtype(tensor: ReaderTensor, path: Path) -> None:
    if tensor.tensor_type in (QType.F32, QType.F16, QType.BF16):
        return
    try:  # one row: proves gguf can dequantize this type without paying for the whole tensor
        dequantize(np.asarray(tensor.data).reshape(-1, tensor.data.shape[-1])[:1], tensor.tensor_type)
    except (NotImplementedError, ValueError) as exc:
        raise ModelLoadError(f"{path}: tensor {tensor.name} uses {tensor.tensor_type.name}, which cannot "
                             f"be dequantized ({exc}); use an F16/BF16/Q8_0/Q4_x/K-quant file") from exc


def _to_torch(tensor: ReaderTensor, num_heads: int) -> torch.Tensor:
    import torch

    shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists dimensions innermost first
    if tensor.tensor_type == QType.F32:
        out = torch.from_numpy(np.array(tensor.data, dtype=np.float32))
    elif tensor.tensor_type == QType.F16:
        out = torch.from_numpy(np.array(tensor.data, dtype=np.float16))
    elif tensor.tensor_type == QType.BF16:
        out = torch.from_numpy(np.array(tensor.data).view(np.int16)).view(torch.bfloat16)
    else:
        out = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type))
    out = out.reshape(shape)
    return unpermute_qk(out, num_heads) if num_heads else out


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `w.reshape(n, 2, d/n/2, *rest).swapaxes(1, 2)` on a q/k weight or bias."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape).contiguous())


def _first(value):
    return value[0] if isinstance(value, list) else value
