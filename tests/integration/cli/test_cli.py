"""The `splitserve` console command, run as a user would run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.text.generate import generate_text
from splitserve.services.worker_protocol.sampling_params import SamplingParams


def splitserve(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(["splitserve", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"]])
def test_help(args):
    result = splitserve(*args)
    assert result.returncode == 0, result.stderr
    assert "usage: splitserve" in result.stdout
    if "generate" in args:
        for flag in ("--model", "--prompt-ids", "--chat", "--max-tokens", "--temperature",
                     "--seed", "--tp", "--dtype", "--json"):
            assert flag in result.stdout


def test_module_entry_point_matches_console_script():
    result = subprocess.run([sys.executable, "-m", "splitserve", "--version"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("splitserve ")


def test_generate_json_matches_the_engine(llama_dir):
    result = splitserve("generate", "--model", str(llama_dir), "--prompt-ids", "1,5,9,200",
                        "--prompt-ids", "3,4", "--max-tokens", "6", "--ignore-eos", "--json",
                        "--kv-cache-gib", "0.05")
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(lines) == 2
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=32))
    expected = generate_text(engine, [[1, 5, 9, 200], [3, 4]], SamplingParams(max_tokens=6, ignore_eos=True))
    for line, want in zip(lines, expected):
        assert line["token_ids"] == want.token_ids
        assert line["text"] == want.text
        assert line["finish_reason"] == "length"


def test_generate_with_tensor_parallelism(llama_dir):
    base = ["generate", "--model", str(llama_dir), "--prompt-ids", "1,5,9,200", "--max-tokens", "5",
            "--ignore-eos", "--json", "--kv-cache-gib", "0.05"]
    one, two = splitserve(*base), splitserve(*base, "--tp", "2")
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert json.loads(one.stdout)["token_ids"] == json.loads(two.stdout)["token_ids"]


def test_generate_smollm2_chat(smollm2_dir):
    # smollm2_dir converted the model into SPLITSERVE_CACHE_DIR's layout; point the CLI at the same cache.
    cache = smollm2_dir.parent.parent
    result = splitserve("generate", "--model", "smollm2", "--chat", "--prompt",
                        "What is the capital of France?", "--max-tokens", "20", "--json",
                        env={"SPLITSERVE_CACHE_DIR": str(cache)})
    assert result.returncode == 0, result.stderr
    assert "Paris" in json.loads(result.stdout)["text"]


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/model", "--prompt", "hi"], "nonexistent"),
    (["--model", "smollm2"], "--prompt"),
    (["--model", "smollm2", "--prompt", "hi", "--dtype", "float8"], "dtype"),
])
def test_generate_errors_are_clear(args, message, smollm2_dir):
    result = splitserve("generate", *args, env={"SPLITSERVE_CACHE_DIR": str(smollm2_dir.parent.parent)})
    assert result.returncode == 2
    assert "splitserve: error:" in result.stderr and message in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_prompt_ids_are_a_usage_error():
    result = splitserve("generate", "--prompt-ids", "1,x")
    assert result.returncode == 2 and "comma-separated integers" in result.stderr
