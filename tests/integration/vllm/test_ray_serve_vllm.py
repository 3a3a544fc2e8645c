"""The Ray Serve target with vLLM workers: ray_vllm_cases.py in a network namespace
(splitserve/testing/ray_netns.py), one Ray start and one vLLM replica (plus Serve's replacement)."""

from __future__ import annotations

from pathlib import Path

from splitserve.services.engine_vllm.environment import engine_env_dir
from splitserve.testing.ray_netns import run_ray_cases

ROOT = Path(__file__).resolve().parents[3]
CASES = Path(__file__).with_name("ray_vllm_cases.py")
TIMEOUT_S = 1500


def test_ray_serve_with_a_vllm_pool_in_a_network_namespace(vllm_python):
    # The child's HOME is a scratch folder: name the engine environment explicitly.
    run_ray_cases(CASES, ROOT, TIMEOUT_S, env={"SPLITSERVE_VLLM_PYTHON": vllm_python,
                                               "SPLITSERVE_ENGINES": str(engine_env_dir().parent)})
