"""Checkpoints as an engine opens them: the shipped SmolLM2 converted once into a bf16 folder.

splitserve/checkpoints/model_source.py resolves a `--model` without torch (the frontend's
needs); converting the shipped Q4_1 GGUF into a bf16 Hugging Face folder needs torch, so
it happens here, on an engine's (or `serve`'s) first use. The conversion writes into a
temporary sibling folder and renames it into place, so an interrupted conversion never
leaves a folder that looks complete; the folder name carries the package version, so a
new package release converts afresh.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

import torch

from splitserve.checkpoints.checkpoint import Checkpoint, write_json
from splitserve.checkpoints.hf_loader import load_hf_folder
from splitserve.checkpoints.model_source import (SMOLLM2_NAMES, SMOLLM2_PACKAGE, TMP_MARK, carry_published_sampling,
                                                 load_gguf, open_checkpoint, remove_abandoned, smollm2_paths)
from splitserve.errors import ModelLoadError

logger = logging.getLogger(__name__)


def open_model(name_or_path: str) -> Checkpoint:
    """`open_checkpoint`, with `smollm2` converted first (an engine loads its weights)."""
    if name_or_path.strip().lower() in SMOLLM2_NAMES:
        return load_hf_folder(resolve_smollm2())
    return open_checkpoint(name_or_path)


def resolve_smollm2(cache_dir: Path | None = None, progress: bool = True,
                    package: str = SMOLLM2_PACKAGE) -> Path:
    """The bf16 Hugging Face folder of SmolLM2-135M-Instruct, converting it on first use.

    Raises ModelLoadError when the package that ships the GGUF is not installed.
    """
    gguf_path, target = smollm2_paths(cache_dir, package)
    if (target / "config.json").is_file():
        carry_published_sampling(target)
        return target
    models = target.parent
    models.mkdir(parents=True, exist_ok=True)
    remove_abandoned(models, target.name)
    tmp = models / f"{target.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    logger.info("converting %s into %s (once)", gguf_path, target)
    try:
        save_pretrained(load_gguf(gguf_path), tmp, dtype=torch.bfloat16, progress=progress)
        if target.exists() and not (target / "config.json").is_file():
            shutil.rmtree(target)  # not ours: we only ever create it complete, by rename
        tmp.rename(target)
    except OSError as exc:
        if not (target / "config.json").is_file():  # else a concurrent conversion won the race
            raise ModelLoadError(f"cannot write the converted model into {models}: {exc}; free some "
                                 "space or point SPLITSERVE_CACHE_DIR at a writable folder") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    carry_published_sampling(target)
    return target


def save_pretrained(checkpoint: Checkpoint, folder: Path, dtype: torch.dtype | None = None,
                    progress: bool = False) -> None:
    """Write a checkpoint as a Hugging Face folder (one safetensors file), in `dtype`
    (default bfloat16)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    dtype = torch.bfloat16 if dtype is None else dtype
    folder.mkdir(parents=True, exist_ok=True)
    stream = checkpoint.tensors()
    if progress:
        stream = tqdm(stream, desc=f"converting {checkpoint.name}", unit="tensor", total=checkpoint.num_tensors)
    weights = {name: t.to(dtype).contiguous() for name, t in stream}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = dict(checkpoint.config)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    write_json(folder / "config.json", config)
    (folder / "tokenizer.json").write_text(checkpoint.tokenizer_json, encoding="utf-8")
    write_json(folder / "tokenizer_config.json", checkpoint.tokenizer_config)
    if checkpoint.generation_config:
        write_json(folder / "generation_config.json", checkpoint.generation_config)
