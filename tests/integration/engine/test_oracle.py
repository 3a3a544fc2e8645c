"""Greedy output of the engine equals transformers' generate token for token (fp32).

DESIGN section 3's oracle: random-weight Llama, Qwen2, Qwen3 (and Mistral) models
built at test time, and the shipped SmolLM2; every batch mixes prompt lengths
1, 7, 64 and 300. Variants force chunked prefill, prefix-cache hits, preemption
and tensor parallelism; each must leave the KV pool empty.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.engine.sampling_params import SamplingParams
from splitserve.testing.oracle import assert_greedy_match, hf_greedy

PROMPT_LENGTHS = (1, 7, 64, 300)
MAX_NEW_TOKENS = 16


def mixed_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def run_engine(folder: Path, prompts: list[list[int]], **config) -> tuple[LLMEngine, list[list[int]]]:
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", **config))
    results = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW_TOKENS, ignore_eos=True))
    return engine, [r.token_ids for r in results]


def assert_all_match(outputs: list[list[int]], refs) -> None:
    for ours, ref in zip(outputs, refs, strict=True):
        assert_greedy_match(ours, ref)


def assert_pool_idle(engine: LLMEngine) -> None:
    pool = engine.pool
    assert not engine.has_unfinished()
    assert all(c == 0 for c in pool.ref_counts), "a finished request still holds blocks"
    assert pool.num_free_blocks == pool.num_blocks


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral"])
def random_model(request) -> tuple[Path, list[list[int]], list]:
    folder = request.getfixturevalue(f"{request.param}_dir")
    prompts = mixed_prompts(32000)
    return folder, prompts, hf_greedy(folder, prompts, MAX_NEW_TOKENS, ignore_eos=True)


def test_batch_of_mixed_lengths_matches(random_model):
    folder, prompts, refs = random_model
    engine, outputs = run_engine(folder, prompts, num_kv_blocks=256)
    assert_all_match(outputs, refs)
    assert engine.stats.num_steps == MAX_NEW_TOKENS  # all prompts prefilled together in one step
    assert_pool_idle(engine)


def test_chunked_prefill_matches(random_model):
    folder, prompts, refs = random_model
    engine, outputs = run_engine(folder, prompts, num_kv_blocks=256, max_num_batched_tokens=32)
    assert_all_match(outputs, refs)
    # 372 prompt tokens at 32 per step cannot fit in fewer than 12 steps
    assert engine.stats.num_steps >= sum(PROMPT_LENGTHS) // 32
    assert_pool_idle(engine)


def test_prefix_cache_hit_matches_with_fewer_tokens(random_model):
    folder, prompts, refs = random_model
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=256))
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    first = engine.generate(prompts, params)
    computed_cold = engine.stats.num_prompt_tokens_computed
    second = engine.generate(prompts, params)
    computed_warm = engine.stats.num_prompt_tokens_computed - computed_cold
    assert [r.token_ids for r in second] == [r.token_ids for r in first]
    assert_all_match([r.token_ids for r in second], refs)
    # Every full 16-token block of the 64- and 300-token prompts is served from the cache.
    assert second[3].num_cached_tokens == 288 and second[2].num_cached_tokens == 48
    assert computed_warm == sum(PROMPT_LENGTHS) - 288 - 48
    assert_pool_idle(engine)


def test_preemption_matches(random_model):
    folder, prompts, refs = random_model
    # 24 blocks of 16 tokens cannot hold the 300-token prompt and the others at once.
    engine, outputs = run_engine(folder, prompts, num_kv_blocks=24, max_num_batched_tokens=64)
    assert_all_match(outputs, refs)
    assert engine.stats.num_preemptions > 0
    assert_pool_idle(engine)


def test_tensor_parallel_two_ranks_matches(random_model):
    folder, prompts, refs = random_model
    engine, outputs = run_engine(folder, prompts, num_kv_blocks=256, tensor_parallel_size=2)
    try:
        assert_all_match(outputs, refs)
        assert_pool_idle(engine)
    finally:
        engine.close()


def test_smollm2_matches(smollm2_dir):
    prompts = mixed_prompts(49152, seed=1)
    refs = hf_greedy(smollm2_dir, prompts, MAX_NEW_TOKENS, ignore_eos=True)
    engine, outputs = run_engine(smollm2_dir, prompts, num_kv_blocks=128, max_num_batched_tokens=128)
    assert_all_match(outputs, refs)
    assert_pool_idle(engine)


def test_smollm2_answers_capital_of_france(smollm2_dir):
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), num_kv_blocks=64))
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}])
    [result] = engine.generate([prompt], SamplingParams(max_tokens=24))
    assert "Paris" in result.text
    assert result.finish_reason.value == "stop"
