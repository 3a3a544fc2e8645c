"""Random-weight checkpoints of the supported model families, built at test time.

The engine is checked against Hugging Face transformers on the same weights
(DESIGN section 3), so tests need real checkpoints that exercise every feature
the engine implements (grouped-query attention, QKV bias, QK-norm, tied
embeddings, RoPE variants) and cost about a second each. `build_random_model`
builds one with transformers, overwrites every parameter from one seeded
generator (so the weights do not depend on transformers' own init scheme),
saves it as fp32 safetensors and adds a real 32000-entry SentencePiece
tokenizer (the Mistral v1 tokenizer shipped in the PyPI package
`mistral-common`), converted to `tokenizer.json`. `random_prompt` draws a seeded
prompt of token ids for them.

Weight scales are chosen so that greedy decoding is not degenerate: with small
weights a random model, tied ones especially, repeats one token forever, which
would let a broken engine pass. transformers is a test-only dependency, so it is
imported inside the functions.

Load the tokenizer with `tokenizers.Tokenizer.from_file` or transformers'
`PreTrainedTokenizerFast.from_pretrained`; `AutoTokenizer` on a qwen2 folder
forces transformers' byte-level Qwen2Tokenizer, which rebuilds a different one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import shutil
from pathlib import Path
from typing import Any

TOKENIZER_RESOURCE = "tokenizer.model.v1"  # in mistral_common/data/
BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<s>", "</s>", "<unk>"
BOS_TOKEN_ID, EOS_TOKEN_ID = 1, 2

# Llama-2 / Mistral-instruct style. It only uses plain jinja2 (no HF helpers such
# as raise_exception) and its whitespace is all inside expressions, so it renders
# the same with or without trim_blocks / lstrip_blocks. It starts with the BOS
# token, like the Llama-2 template: tokenize the result without adding specials.
CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system_message = messages[0]['content'] -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system_message = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{{- bos_token -}}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{%- if loop.first and system_message -%}"
    "{{- '[INST] <<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] + ' [/INST]' -}}"
    "{%- else -%}"
    "{{- '[INST] ' + message['content'] + ' [/INST]' -}}"
    "{%- endif -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- ' ' + message['content'] + eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# Shared by every family: DESIGN section 3's test model.
BASE_CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 688,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    # Std of every matrix. 0.02 (the usual value) makes the layers too weak next to
    # the embeddings and greedy output collapses to one repeated token.
    "initializer_range": 0.08,
}

# Per family: transformers config class and what sets the family apart.
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
    # sliding_window=None: Mistral v0.2+ style full attention (v0.1 used 4096).
    "mistral": ("MistralConfig", {"tie_word_embeddings": False, "sliding_window": None}),
    # Qwen2's q/k/v projections always carry a bias.
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    # Qwen3 always has QK-norm (RMSNorm over each head of q and k).
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": False, "attention_bias": False}),
}

# Norm weights are drawn around 1 (so that a missing norm weight shows), biases
# around 0 with this std.
NORM_WEIGHT_STD = 0.2
BIAS_STD = 0.1


def build_random_model(arch: str, folder: Path, *, seed: int = 0, **config_overrides: Any) -> Path:
    """Build a random-weight `arch` checkpoint into `folder` and return `folder`.

    `arch` is one of ARCHS. `config_overrides` replace config fields (for example
    `num_hidden_layers=2`, `tie_word_embeddings=True`,
    `rope_parameters={"rope_type": "linear", "factor": 2.0}` or the legacy
    `rope_scaling=`; transformers 5 writes both as `rope_parameters`, with
    `rope_theta` inside). The same arch, seed and overrides give byte-identical
    files. The folder holds config.json, model.safetensors (fp32),
    generation_config.json, tokenizer.json and tokenizer_config.json.
    """
    import torch

    config = make_config(arch, **config_overrides)
    with torch.device("cpu"):
        model = _new_model(config)
    randomize_weights(model, seed=arch_seed(arch, seed), std=config.initializer_range)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    _write_generation_config(folder)
    write_tokenizer(folder)
    return folder


def random_prompt(seed: int, num_tokens: int) -> list[int]:
    """`num_tokens` token ids drawn from a generator seeded with `seed`: a prompt of the test
    models' vocabulary without its special tokens (<unk>, <s>, </s> are ids 0 to 2), the same
    on every run. Prompts of distinct seeds are unrelated: a prefix cache matches none against another."""
    rng = random.Random(seed)
    return [rng.randrange(EOS_TOKEN_ID + 1, BASE_CONFIG["vocab_size"]) for _ in range(num_tokens)]


def make_config(arch: str, **config_overrides: Any):
    """The transformers config for `arch` with `config_overrides` applied."""
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHS)}")
    class_name, arch_fields = ARCHS[arch]
    fields = {**BASE_CONFIG, **arch_fields, **config_overrides}
    rope_parameters = fields.get("rope_parameters")
    if rope_parameters is not None:
        # rope_parameters carries rope_theta in transformers 5; keep ours unless given.
        fields["rope_parameters"] = {"rope_theta": fields.pop("rope_theta"), **rope_parameters}
    config = getattr(transformers, class_name)(**fields)
    config.dtype = "float32"
    return config


def arch_seed(arch: str, seed: int) -> int:
    """The generator seed for `arch`: llama and mistral have the same parameter
    names and shapes, and would otherwise get identical weights."""
    digest = hashlib.sha256(f"{arch}:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _new_model(config):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def randomize_weights(model, *, seed: int, std: float) -> None:
    """Overwrite every parameter from one generator seeded with `seed`.

    Parameters are visited in name order (tied ones once), so the result depends
    only on the seed and the parameter shapes. Matrices ~ N(0, std); 1-D norm
    weights ~ N(1, NORM_WEIGHT_STD); biases ~ N(0, BIAS_STD). transformers may
    init biases to zero and norms to one, which would hide a missing bias or norm.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if param.ndim >= 2:
                values.mul_(std)
            elif "norm" in name:
                values.mul_(NORM_WEIGHT_STD).add_(1.0)
            else:
                values.mul_(BIAS_STD)
            param.copy_(values)


def _write_generation_config(folder: Path) -> None:
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, do_sample=False).save_pretrained(folder)


def sentencepiece_model_path() -> Path:
    """The Mistral v1 SentencePiece model (32000 pieces) inside mistral-common."""
    from importlib import resources

    path = Path(str(resources.files("mistral_common") / "data" / TOKENIZER_RESOURCE))
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; `pip install mistral-common` provides it")
    return path


def write_tokenizer(folder: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json for the test tokenizer."""
    folder = Path(folder)
    cached = _tokenizer_json_file()
    shutil.copyfile(cached, folder / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": BASE_CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


@functools.cache
def _tokenizer_json_file() -> Path:
    """Convert the SentencePiece model once per process (about 0.2 s) into a temp file."""
    import atexit
    import tempfile

    tmp_dir = Path(tempfile.mkdtemp(prefix="splitserve-tokenizer-"))
    atexit.register(shutil.rmtree, tmp_dir, True)
    path = tmp_dir / "tokenizer.json"
    path.write_text(_convert_sentencepiece(sentencepiece_model_path()))
    return path


def _convert_sentencepiece(model_path: Path) -> str:
    """tokenizer.json text that encodes exactly like SentencePiece, plus a BOS.

    transformers' SpmConverter follows the model's own normalizer spec (dummy
    prefix, whitespace escaping, byte fallback, merges ranked by piece score);
    legacy=True matches `SentencePieceProcessor.encode` on every text, including
    leading and repeated spaces. The post-processor prepends `<s>`, as
    Llama/Mistral tokenizers do.
    """
    from tokenizers import AddedToken, processors
    from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

    proto = SentencePieceExtractor(str(model_path)).proto
    vocab = {piece.piece: index for index, piece in enumerate(proto.pieces)}
    tokenizer = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN)]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
    )
    return tokenizer.to_str(pretty=True)
