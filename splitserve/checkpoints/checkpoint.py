"""A model checkpoint as the engine sees it, whatever file format it came from.

Both loaders (Hugging Face folder, GGUF file) produce a `Checkpoint`: the HF
`config.json` contents, a lazy stream of tensors under Hugging Face parameter
names, and the tokenizer in `tokenizers` JSON form. Everything downstream (model
construction, tensor-parallel sharding, the SmolLM2 cache) reads only this.

torch is imported only where tensors are made (TYPE_CHECKING for the
annotations): the frontend opens checkpoints for their tokenizer and must start
without torch (tests/unit/frontend/test_no_torch.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from splitserve.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

TensorStream = Callable[[], Iterator[tuple[str, "torch.Tensor"]]]


@dataclass(slots=True)
class Checkpoint:
    """Weights, config and tokenizer of one model.

    `tensors()` yields `(hf_name, tensor)` pairs, e.g. `model.layers.0.self_attn.q_proj.weight`,
    in any floating dtype; each call starts a fresh pass, so callers can stream
    without holding two copies.
    """

    name: str
    config: dict
    tensors: TensorStream
    tokenizer_json: str
    tokenizer_config: dict = field(default_factory=dict)
    generation_config: dict = field(default_factory=dict)
    source: str = ""
    num_tensors: int | None = None     # for progress bars, when the format tells



def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelLoadError(f"missing model file: {path}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"corrupt model file {path}: {exc}") from exc
