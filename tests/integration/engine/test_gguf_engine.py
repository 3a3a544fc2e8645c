"""The engine on a GGUF file directly equals transformers on the same GGUF file.

transformers dequantizes GGUF independently of our loader (its own tensor
mapping and Q/K un-permutation), so agreement checks the whole GGUF path:
dequantization, names, the llama.cpp permutation and the tokenizer.
"""

from __future__ import annotations

import torch

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.checkpoints.model_source import find_packaged_gguf
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.testing.oracle import assert_greedy_match, greedy_reference


def test_smollm2_gguf_matches_transformers_gguf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, _version = find_packaged_gguf()
    engine = LLMEngine(EngineConfig(model=str(gguf_path), dtype="float32", num_kv_blocks=64))
    hf_tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    text = "The three primary colours are"
    assert engine.tokenizer.encode(text) == hf_tokenizer(text)["input_ids"]
    prompts = [engine.tokenizer.encode(text), engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about the sea."}])]
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 dtype=torch.float32).eval()
    results = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert_greedy_match(result.token_ids, greedy_reference(model, prompt, 12, ignore_eos=True))
