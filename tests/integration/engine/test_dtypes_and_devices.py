"""Half-precision dtypes on CPU, and the CUDA oracle for the device check.

bf16/fp16 cannot be token-exact against fp32, so they are held to closeness: the
same first token wherever fp32 is decisive, and log-probabilities within a
tolerance fit for the format. The `gpu` tests run only on a CUDA machine.
"""

from __future__ import annotations

import pytest
import torch

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.text.generate import generate_text
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.testing.oracle import assert_greedy_match, hf_greedy

PROMPTS = [list(range(3, 40)), [1, 9, 99, 999], list(range(500, 800, 7))]


def first_token_logprobs(folder, dtype: str, device: str = "cpu"):
    engine = LLMEngine(EngineConfig(model=str(folder), dtype=dtype, device=device, num_kv_blocks=64))
    results = engine.generate(PROMPTS, SamplingParams(max_tokens=1, logprobs=2))
    return [r.logprobs[0] for r in results]


@pytest.mark.parametrize("dtype, tolerance", [("bfloat16", 0.15), ("float16", 0.03)])
def test_half_precision_agrees_with_float32(llama_dir, dtype, tolerance):
    reference = first_token_logprobs(llama_dir, "float32")
    half = first_token_logprobs(llama_dir, dtype)
    for ref, got in zip(reference, half):
        top = sorted(ref.top_logprobs.values(), reverse=True)
        if top[0] - top[1] > 2 * tolerance:
            assert got.token_id == ref.token_id
        assert got.top_logprobs.get(ref.token_id, got.logprob - 1) == pytest.approx(ref.logprob, abs=tolerance)
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype=dtype, num_kv_blocks=8))
    assert engine.runner.kv.tensor.dtype == getattr(torch, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_cuda_float32_oracle(arch, request):
    folder = request.getfixturevalue(f"{arch}_dir")
    refs = hf_greedy(folder, PROMPTS, 16, ignore_eos=True)
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", device="cuda", num_kv_blocks=64))
    results = engine.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))
    for result, ref in zip(results, refs, strict=True):
        assert_greedy_match(result.token_ids, ref)


@pytest.mark.gpu
def test_cuda_bfloat16_smollm2_answers(smollm2_dir):
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), dtype="bfloat16", device="cuda", num_kv_blocks=64))
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    [result] = generate_text(engine, [prompt], SamplingParams(max_tokens=24))
    assert "Paris" in result.text
