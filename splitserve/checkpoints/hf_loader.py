"""Load a local Hugging Face model folder into a `Checkpoint`.

A folder holds `config.json`, the weights as one `model.safetensors`, several
shards named by `model.safetensors.index.json`, or any `*.safetensors` files,
and the tokenizer as `tokenizer.json` plus an optional `tokenizer_config.json`
(transformers 5 saves the chat template beside it as `chat_template.jinja`).

Everything that can be checked without reading the weights is checked here, up
front, so a bad folder fails at load time with a message that names the file:
every shard's safetensors header is opened (that catches truncated and garbage
files); the tensors themselves are streamed lazily, shard by shard. Nothing is
ever fetched from a hub. Opening a folder needs no torch (the headers are read
with safetensors' numpy front end); streaming its tensors imports it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError, safe_open

from splitserve.errors import ModelLoadError
from splitserve.checkpoints.checkpoint import Checkpoint, read_json

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def load_hf_folder(path: Path) -> Checkpoint:
    """Read a Hugging Face folder; tensors are streamed on each `tensors()` call.

    Raises ModelLoadError naming the file when config.json, the weights or
    tokenizer.json is missing, or when a JSON or safetensors file is corrupt.
    """
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model folder {path} does not exist or is not a folder")
    config = read_json(path / "config.json")
    shards = find_weight_files(path)
    for shard in shards:
        _check_header(shard)
    tokenizer_json = _read_tokenizer_json(path / "tokenizer.json")
    tokenizer_config = read_tokenizer_config(path)
    generation_config = {}
    if (path / "generation_config.json").is_file():
        generation_config = read_json(path / "generation_config.json")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for shard in shards:
            yield from _stream_shard(shard)

    logger.info("loaded model folder %s (%d weight file(s))", path, len(shards))
    return Checkpoint(name=path.name, config=config, tensors=tensors,
                      tokenizer_json=tokenizer_json, tokenizer_config=tokenizer_config,
                      generation_config=generation_config, source=str(path))


def find_weight_files(path: Path) -> list[Path]:
    """The safetensors files of a folder, in load order.

    The index file wins when present (only the shards it names are read), then
    the single-file name, then every `*.safetensors` in name order.
    """
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"corrupt model file {index}: it has no 'weight_map'; "
                                 "re-save the model or remove the index to load every *.safetensors file")
        shards = [path / name for name in dict.fromkeys(weight_map.values())]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names weight shards that are missing: {', '.join(missing)}; "
                                 "copy the complete model folder again")
        return shards
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        extra = " (PyTorch .bin weights are not supported; convert them to safetensors)" \
            if any(path.glob("*.bin")) else ""
        raise ModelLoadError(f"no weights in {path}: expected {SINGLE_FILE}, {INDEX_FILE} with its shards, "
                             f"or *.safetensors files{extra}")
    return shards


def read_tokenizer_config(path: Path) -> dict:
    """tokenizer_config.json (optional) with the chat template and special tokens resolved.

    `chat_template.jinja` beside it wins over a `chat_template` key, as in
    transformers 5. Special tokens saved in AddedToken form (`{"content": ...}`)
    become plain strings.
    """
    config_file = path / "tokenizer_config.json"
    config = read_json(config_file) if config_file.is_file() else {}
    template_file = path / CHAT_TEMPLATE_FILE
    if template_file.is_file():
        try:
            config["chat_template"] = template_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ModelLoadError(f"corrupt model file {template_file}: not UTF-8 text ({exc})") from exc
    for key in _SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):
            config[key] = value.get("content")
    return config


def _read_tokenizer_json(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
        json.loads(text)
    except FileNotFoundError as exc:
        raise ModelLoadError(f"missing model file: {path}; splitserve needs the fast tokenizer "
                             "(tokenizer.json) saved with the model") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"corrupt model file {path}: {exc}; copy it again from the model's source") from exc
    return text


def _check_header(shard: Path) -> None:
    try:
        with safe_open(str(shard), framework="numpy") as f:     # "pt" would import torch
            f.keys()
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"corrupt weight file {shard}: {exc}; the file is truncated or not "
                             "safetensors, copy it again from the model's source") from exc


def _stream_shard(shard: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"cannot read weights from {shard}: {exc}") from exc
