"""The engine's request API on a real (random-weight) model: sampling, abort,
KV events, stop conditions and bad input. Every test ends with the pool idle.
Text and stop strings are the frontend's: they are checked through the text
module over the engine (services/text/generate.py), as `splitserve generate` runs."""

from __future__ import annotations

import json
import shutil

import pytest

from splitserve.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError
from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.engine_api.kv_events import AllCleared, BlockRemoved, BlockStored
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.services.engine.sequence import FinishReason
from splitserve.services.text.generate import generate_text


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=64,
                                  max_num_batched_tokens=256))


PROMPTS = [[1, 300, 301, 302], list(range(40, 90)), [1, 7]]


def sampled(engine, prompts, **params):
    return [r.token_ids for r in engine.generate(prompts, SamplingParams(max_tokens=12, **params))]


def test_seeded_sampling_is_reproducible_across_batches(engine):
    alone = sampled(engine, PROMPTS[:1], temperature=1.0, top_p=0.9, seed=42)
    in_batch = sampled(engine, PROMPTS, temperature=1.0, top_p=0.9, seed=42)
    assert in_batch[0] == alone[0]
    other_seed = sampled(engine, PROMPTS[:1], temperature=1.0, top_p=0.9, seed=43)
    assert other_seed[0] != alone[0]


def test_top_k_one_is_greedy(engine):
    assert sampled(engine, PROMPTS, temperature=0.8, top_k=1, seed=1) == sampled(engine, PROMPTS)


def test_logprobs_are_reported(engine):
    [result] = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=4, logprobs=3))
    assert len(result.logprobs) == 4
    for token_id, lp in zip(result.token_ids, result.logprobs):
        assert lp.token_id == token_id and lp.logprob <= 0.0
        assert len(lp.top_logprobs) == 3
        assert max(lp.top_logprobs.values()) == pytest.approx(lp.logprob)  # greedy took the top one


def test_stop_token_ids_and_max_tokens(engine):
    [free] = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert free.finish_reason is FinishReason.LENGTH and len(free.token_ids) == 8
    stop_at = free.token_ids[3]
    [stopped] = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=8, stop_token_ids=[stop_at],
                                                             ignore_eos=True))
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == free.token_ids[:free.token_ids.index(stop_at) + 1]


def test_stop_string_cuts_text(engine):
    [free] = generate_text(engine, [PROMPTS[1]], SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(free.text) > 6
    stop = free.text[4:7]
    [cut] = generate_text(engine, [PROMPTS[1]], SamplingParams(max_tokens=12, stop=[stop], ignore_eos=True))
    assert cut.finish_reason is FinishReason.STOP
    assert cut.text == free.text[:free.text.index(stop)]
    [kept] = generate_text(engine, [PROMPTS[1]], SamplingParams(max_tokens=12, stop=[stop], ignore_eos=True,
                                                                include_stop_str_in_output=True))
    assert kept.text == free.text[:free.text.index(stop) + len(stop)]


def test_streamed_text_equals_decoded_tokens(engine):
    """The output text is what the tokens add to the prompt's text (with the leading space a
    SentencePiece token decoded alone loses)."""
    prompt_ids = PROMPTS[2]
    [result] = generate_text(engine, [prompt_ids], SamplingParams(max_tokens=20, ignore_eos=True))
    prompt_text = engine.tokenizer.decode(prompt_ids)
    whole = engine.tokenizer.decode(prompt_ids + result.token_ids)
    assert whole.startswith(prompt_text) and result.text == whole[len(prompt_text):]


def test_abort_frees_blocks_of_running_and_waiting_requests(engine):
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    engine.add_request("running", PROMPTS[1], params)
    engine.step()
    engine.step()
    assert engine.pool.num_used_blocks > 0
    engine.add_request("waiting", PROMPTS[0], params)
    assert engine.abort("running") and engine.abort("waiting")
    assert not engine.abort("unknown")
    assert engine.pool.num_used_blocks == 0
    finals = {o.request_id: o for o in engine.step()}
    assert finals["running"].finish_reason is FinishReason.ABORT and finals["running"].finished
    assert finals["waiting"].finish_reason is FinishReason.ABORT


def test_kv_events_mirror_the_prefix_cache(llama_dir):
    # A small pool forces evictions, so both kinds of events occur.
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=12))
    mirror: set[bytes] = set()
    seqs: list[int] = []
    num_removed = 0
    for i in range(6):
        engine.generate([list(range(10 + 30 * i, 80 + 30 * i))], SamplingParams(max_tokens=10, ignore_eos=True))
        for event in engine.take_events():
            seqs.append(event.seq)
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == 16 * len(event.block_hashes)
                mirror.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= mirror
                num_removed += 1
                mirror.difference_update(event.block_hashes)
            elif isinstance(event, AllCleared):
                mirror.clear()
        assert mirror == set(engine.pool.cached)
    assert seqs == list(range(1, len(seqs) + 1))
    assert num_removed > 0, "the small pool should have evicted cached blocks"


def test_event_subscribers_each_get_every_event_in_order(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=12))
    seen_a, seen_b = [], []
    engine.subscribe_events(seen_a.extend)
    engine.subscribe_events(seen_b.extend)
    for i in range(4):
        engine.generate([list(range(10 + 40 * i, 90 + 40 * i))], SamplingParams(max_tokens=4))
    assert seen_a == seen_b and len(seen_a) > 10
    assert [e.seq for e in seen_a] == list(range(1, len(seen_a) + 1))
    assert any(isinstance(e, BlockRemoved) for e in seen_a)


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "empty"),
    ([1] * 5000, SamplingParams(), "context"),
    ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
    ([1, 32000], SamplingParams(), r"\[0, 32000\)"),
    ([1, 2], SamplingParams(top_p=0.0), "top_p"),
    ([1, 2], SamplingParams(temperature=-1.0), "temperature"),
])
def test_bad_requests_are_rejected_and_leave_nothing(engine, prompt, params, match):
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished()
    engine.add_request("bad", [1, 2], SamplingParams(max_tokens=1))   # the id is free again
    engine.generate([[3]], SamplingParams(max_tokens=1))


def test_duplicate_request_id_is_rejected(engine):
    engine.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    engine.abort("dup")


def test_missing_weights_are_a_clear_error(llama_dir, tmp_path):
    broken = shutil.copytree(llama_dir, tmp_path / "m")
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLMEngine(EngineConfig(model=str(broken)))


def test_corrupt_weights_are_a_clear_error(llama_dir, tmp_path):
    broken = shutil.copytree(llama_dir, tmp_path / "m")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError):
        LLMEngine(EngineConfig(model=str(broken)))


def test_unknown_architecture_is_a_clear_error(llama_dir, tmp_path):
    broken = shutil.copytree(llama_dir, tmp_path / "m")
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPTNeoXForCausalLM"):
        LLMEngine(EngineConfig(model=str(broken)))


def test_requests_sharing_a_new_prefix_compute_it_once(engine):
    shared = list(range(1000, 1064))                   # 4 blocks of 16 that no request cached yet
    prompts = [shared + [5, 6], shared + [7, 8], shared + [9]]
    together = engine.stats.num_prompt_tokens_computed
    outputs = sampled(engine, prompts, temperature=0)   # together: one step's budget fits all three
    together = engine.stats.num_prompt_tokens_computed - together
    assert together == 64 + 2 + 2 + 1                  # the prefix once, then each request's own tail
    assert outputs == [sampled(engine, [p], temperature=0)[0] for p in prompts]
