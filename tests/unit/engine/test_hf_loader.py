"""Loading a local Hugging Face folder: weight layouts, tokenizer files, and bad folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from splitserve.errors import ModelLoadError
from splitserve.checkpoints.checkpoint import Checkpoint
from splitserve.services.engine.loading.smollm2 import save_pretrained
from splitserve.checkpoints.hf_loader import load_hf_folder

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8,
          "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 4}
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    weights = {"model.embed_tokens.weight": torch.randn(4, 8, generator=gen)}
    for layer in range(2):
        weights[f"model.layers.{layer}.self_attn.q_proj.weight"] = torch.randn(8, 8, generator=gen)
        weights[f"model.layers.{layer}.input_layernorm.weight"] = torch.randn(8, generator=gen)
    return weights


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data), encoding="utf-8")


def _folder(path: Path, layout: str = "single") -> dict[str, torch.Tensor]:
    """A small model folder; `layout` is single | index | glob."""
    path.mkdir(parents=True, exist_ok=True)
    weights = _weights()
    _write_json(path / "config.json", CONFIG)
    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (path / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    _write_json(path / "tokenizer_config.json", {
        "bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "__type": "AddedToken"},
        "eos_token": "</s>", "add_bos_token": True})
    _write_json(path / "generation_config.json", {"eos_token_id": 1, "bos_token_id": 0})
    names = sorted(weights)
    if layout == "single":
        save_file(weights, str(path / "model.safetensors"))
    else:
        halves = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
        for shard, shard_names in halves.items():
            save_file({n: weights[n] for n in shard_names}, str(path / shard))
        if layout == "index":
            weight_map = {n: shard for shard, shard_names in halves.items() for n in shard_names}
            _write_json(path / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})
    return weights


def _assert_same(ckpt: Checkpoint, weights: dict[str, torch.Tensor]) -> None:
    got = dict(ckpt.tensors())
    assert set(got) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("layout", ["single", "index", "glob"])
def test_weight_layouts(tmp_path: Path, layout: str) -> None:
    weights = _folder(tmp_path / "m", layout)
    ckpt = load_hf_folder(tmp_path / "m")
    _assert_same(ckpt, weights)
    _assert_same(ckpt, weights)  # every call starts a fresh pass
    assert ckpt.config == CONFIG and ckpt.name == "m" and ckpt.source == str(tmp_path / "m")
    assert ckpt.generation_config == {"eos_token_id": 1, "bos_token_id": 0}


def test_index_reads_only_the_shards_it_names(tmp_path: Path) -> None:
    weights = _folder(tmp_path / "m", "index")
    save_file({"stray.weight": torch.zeros(2)}, str(tmp_path / "m" / "consolidated.safetensors"))
    _assert_same(load_hf_folder(tmp_path / "m"), weights)


def test_tensors_are_streamed_lazily(tmp_path: Path) -> None:
    _folder(tmp_path / "m", "index")
    ckpt = load_hf_folder(tmp_path / "m")
    stream = ckpt.tensors()
    name, _ = next(stream)
    assert name.startswith("model.")
    stream.close()


def test_special_tokens_in_added_token_form_become_strings(tmp_path: Path) -> None:
    _folder(tmp_path / "m")
    config = load_hf_folder(tmp_path / "m").tokenizer_config
    assert config["bos_token"] == "<s>" and config["eos_token"] == "</s>" and config["add_bos_token"] is True


def test_chat_template_jinja_file(tmp_path: Path) -> None:
    """transformers 5 saves the template as chat_template.jinja; it wins over the JSON key."""
    _folder(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    _write_json(tmp_path / "m" / "tokenizer_config.json", {**config, "chat_template": "old"})
    (tmp_path / "m" / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    assert load_hf_folder(tmp_path / "m").tokenizer_config["chat_template"] == TEMPLATE


def test_chat_template_key_and_optional_files(tmp_path: Path) -> None:
    _folder(tmp_path / "m")
    _write_json(tmp_path / "m" / "tokenizer_config.json", {"chat_template": TEMPLATE})
    (tmp_path / "m" / "generation_config.json").unlink()
    ckpt = load_hf_folder(tmp_path / "m")
    assert ckpt.tokenizer_config == {"chat_template": TEMPLATE} and ckpt.generation_config == {}
    (tmp_path / "m" / "tokenizer_config.json").unlink()
    assert load_hf_folder(tmp_path / "m").tokenizer_config == {}


def test_save_pretrained_round_trip(tmp_path: Path) -> None:
    weights = _folder(tmp_path / "m")
    (tmp_path / "m" / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    save_pretrained(load_hf_folder(tmp_path / "m"), tmp_path / "copy", dtype=torch.float32)
    copy = load_hf_folder(tmp_path / "copy")
    _assert_same(copy, weights)
    assert copy.tokenizer_config["chat_template"] == TEMPLATE and copy.tokenizer_config["bos_token"] == "<s>"
    assert Tokenizer.from_str(copy.tokenizer_json).encode("b a b").ids == [3, 2, 3]


def _break(folder: Path, damage: str) -> str:
    """Damage a model folder; returns the file name the error must mention."""
    if damage == "no_config":
        (folder / "config.json").unlink()
        return "config.json"
    if damage == "corrupt_config":
        (folder / "config.json").write_text('{"hidden_size": ', encoding="utf-8")
        return "config.json"
    if damage == "no_tokenizer":
        (folder / "tokenizer.json").unlink()
        return "tokenizer.json"
    if damage == "corrupt_tokenizer":
        (folder / "tokenizer.json").write_bytes(b"\xff\xfe garbage")
        return "tokenizer.json"
    if damage == "corrupt_tokenizer_config":
        (folder / "tokenizer_config.json").write_text("{", encoding="utf-8")
        return "tokenizer_config.json"
    if damage == "no_weights":
        (folder / "model.safetensors").unlink()
        (folder / "pytorch_model.bin").write_bytes(b"")
        return "safetensors"
    if damage == "truncated_weights":
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[:-100])
        return "model.safetensors"
    if damage == "garbage_weights":
        (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
        return "model.safetensors"
    raise AssertionError(damage)


@pytest.mark.parametrize("damage", ["no_config", "corrupt_config", "no_tokenizer", "corrupt_tokenizer",
                                    "corrupt_tokenizer_config", "no_weights", "truncated_weights",
                                    "garbage_weights"])
def test_broken_folder(tmp_path: Path, damage: str) -> None:
    _folder(tmp_path / "m")
    named = _break(tmp_path / "m", damage)
    with pytest.raises(ModelLoadError, match=named) as info:
        load_hf_folder(tmp_path / "m")
    if damage == "no_weights":
        assert ".bin weights are not supported" in str(info.value)


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    _folder(tmp_path / "m", "index")
    (tmp_path / "m" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        load_hf_folder(tmp_path / "m")


def test_not_a_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_hf_folder(tmp_path / "nowhere")
