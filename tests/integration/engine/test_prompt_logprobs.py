"""Prompt logprobs in the engine against a transformers forward pass of the same random model.

Each prompt token from the second on gets its logprob under the model's distribution at
the position before it, and the top-n there: equal to transformers' log-softmax of the
whole prompt's logits, whatever the prefill's chunking, the batch around it, a prefix-cache
entry for the same prompt (the request recomputes it: cached blocks have no logits) or a
preemption on the way.
"""

from __future__ import annotations

import pytest
import torch

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.worker_protocol.sampling_params import SamplingParams

PROMPT = [1] + [(37 * i + 11) % 31000 + 2 for i in range(45)]
TOP = 3


@pytest.fixture(scope="module")
def reference(llama_dir) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module")
def engine(llama_dir):
    # 16 tokens per step: the 46-token prompt is prefilled over 3 chunks.
    e = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=64,
                               max_num_batched_tokens=16, block_size=16, num_threads=1))
    yield e
    e.close()


def _assert_matches(entries, reference: torch.Tensor, top: int) -> None:
    assert [e.token_id for e in entries] == PROMPT[1:]
    want = reference[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    torch.testing.assert_close(torch.tensor([e.logprob for e in entries]), want, rtol=1e-4, atol=1e-4)
    for p, e in enumerate(entries):
        # The rank among the vocabulary, up to near-ties (float32 sums differ in their last bits).
        chosen = reference[p, PROMPT[p + 1]]
        assert int((reference[p] > chosen + 1e-4).sum()) + 1 <= e.rank <= int((reference[p] > chosen - 1e-4).sum()) + 1
        values, ids = reference[p].topk(top)
        assert list(e.top_logprobs) == ids.tolist()
        torch.testing.assert_close(torch.tensor(list(e.top_logprobs.values())), values, rtol=1e-4, atol=1e-4)


def test_prompt_logprobs_equal_transformers_over_chunks_and_a_batch(engine, reference):
    others = [list(range(100, 130)), [5, 6, 7]]
    results = engine.generate([PROMPT] + others, [SamplingParams(max_tokens=3, prompt_logprobs=TOP)]
                              + [SamplingParams(max_tokens=3)] * 2)
    _assert_matches(results[0].prompt_logprobs, reference, TOP)
    assert all(r.prompt_logprobs is None for r in results[1:])
    [zero] = engine.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert [e.top_logprobs for e in zero.prompt_logprobs] == [{}] * (len(PROMPT) - 1)


def test_a_cached_prompt_is_recomputed_for_its_logprobs(engine, reference):
    [plain] = engine.generate([PROMPT], SamplingParams(max_tokens=2))      # caches the prompt's blocks
    [again] = engine.generate([PROMPT], SamplingParams(max_tokens=2))
    assert again.num_cached_tokens == 32
    [scored] = engine.generate([PROMPT], SamplingParams(max_tokens=2, prompt_logprobs=TOP))
    assert scored.num_cached_tokens == 0 and scored.token_ids == plain.token_ids
    _assert_matches(scored.prompt_logprobs, reference, TOP)


def test_preempted_request_sends_its_prompt_logprobs_once(llama_dir, reference):
    """A pool too small for both: one request is preempted and recomputed; its prompt logprobs
    are still one entry per token, sent once."""
    e = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=6, block_size=16,
                               max_num_batched_tokens=64, num_threads=1))
    try:
        params = SamplingParams(max_tokens=30, prompt_logprobs=TOP, ignore_eos=True)
        e.add_request("a", PROMPT, params)
        e.add_request("b", PROMPT, params)
        sent: dict[str, list] = {"a": [], "b": []}
        while e.has_unfinished():
            for out in e.step():
                if out.prompt_logprobs is not None:
                    sent[out.request_id].append(out.prompt_logprobs)
        assert e.stats.num_preemptions > 0
        for rid in ("a", "b"):
            assert len(sent[rid]) == 1
            _assert_matches(sent[rid][0], reference, TOP)
    finally:
        e.close()
