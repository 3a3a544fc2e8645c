"""RoPE scaling variants used by Llama-family configs agree with transformers."""

from __future__ import annotations

import pytest

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.testing.models import build_random_model
from splitserve.testing.oracle import assert_greedy_match, hf_greedy

VARIANTS = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 1024},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rope_variant_matches_transformers(variant, tmp_path):
    folder = build_random_model("llama", tmp_path / variant, seed=3,
                                rope_parameters=VARIANTS[variant])
    prompts = [list(range(5, 605, 3)), [7, 8, 9]]   # a 200-token prompt reaches far positions
    refs = hf_greedy(folder, prompts, 8, ignore_eos=True)
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=64))
    results = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    for result, ref in zip(results, refs, strict=True):
        assert_greedy_match(result.token_ids, ref)


def test_unknown_rope_type_is_rejected(tmp_path):
    from splitserve.errors import UnsupportedModelError
    from splitserve.services.engine.config import ModelConfig

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
              "num_hidden_layers": 1, "vocab_size": 10, "intermediate_size": 8,
              "rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}
    with pytest.raises(UnsupportedModelError, match="longrope"):
        ModelConfig.from_hf(config)
