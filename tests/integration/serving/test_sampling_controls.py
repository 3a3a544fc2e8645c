"""Penalties, logit_bias, min_tokens and stop_token_ids through `splitserve serve --aggregated`
with the official `openai` client, on the random-weight Llama checkpoint.

Each control must have its effect (a large negative bias moves the greedy token,
min_tokens holds EOS and stop tokens back) and give exactly the tokens of an
independent reference: transformers' `generate(repetition_penalty=...)` for the
repetition penalty, and a transformers greedy loop with OpenAI's presence/frequency
formula for those two (transformers has no processor for them).
"""

from __future__ import annotations

import openai
import pytest
import torch

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.testing.oracle import assert_greedy_match, hf_greedy

PROMPT_IDS = [1, 415, 2936, 9060, 285, 1142, 28705, 28740, 28734, 2421]
CHAT = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def server(llama_server):
    return llama_server


@pytest.fixture(scope="module")
def engine(llama_dir):
    e = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=128, num_threads=1))
    yield e
    e.close()


def _complete(client, model_name, max_tokens: int, **extra):
    out = client.completions.create(model=model_name, prompt=PROMPT_IDS, max_tokens=max_tokens, temperature=0,
                                    extra_body={"return_token_ids": True, **extra})
    return out.choices[0], out.usage


def _greedy(engine, max_tokens: int, **params) -> list[int]:
    [r] = engine.generate([PROMPT_IDS], SamplingParams(max_tokens=max_tokens, **params))
    return r.token_ids


def test_a_large_negative_logit_bias_moves_the_greedy_token(client, model_name, engine):
    [first] = _greedy(engine, 1, ignore_eos=True)
    choice, _ = _complete(client, model_name, 6, ignore_eos=True, logit_bias={str(first): -100})
    assert choice.token_ids[0] != first
    assert first not in choice.token_ids
    assert choice.token_ids == _greedy(engine, 6, ignore_eos=True, logit_bias={first: -100.0})
    # Beyond +-100 the bias is clamped like vLLM's, not refused: the same tokens.
    clamped, _ = _complete(client, model_name, 6, ignore_eos=True, logit_bias={str(first): -1e6})
    assert clamped.token_ids == choice.token_ids


def test_min_tokens_holds_eos_back(client, model_name, engine):
    eos = min(engine.eos_token_ids)
    bias = {str(eos): 100}                          # EOS is the greedy token at every step
    early, usage = _complete(client, model_name, 10, logit_bias=bias)
    assert (early.token_ids, early.finish_reason, usage.completion_tokens) == ([eos], "stop", 1)
    held, _ = _complete(client, model_name, 10, logit_bias=bias, min_tokens=5)
    assert held.finish_reason == "stop" and held.token_ids[-1] == eos
    assert len(held.token_ids) == 6 and eos not in held.token_ids[:5]
    assert held.token_ids == _greedy(engine, 10, logit_bias={eos: 100.0}, min_tokens=5)


def test_stop_token_ids_and_min_tokens(client, model_name, engine):
    plain = _greedy(engine, 8, ignore_eos=True)
    stop = plain[2]
    choice, _ = _complete(client, model_name, 8, ignore_eos=True, stop_token_ids=[stop])
    assert choice.finish_reason == "stop" and choice.token_ids == plain[:plain.index(stop) + 1]
    held, _ = _complete(client, model_name, 8, ignore_eos=True, stop_token_ids=[stop], min_tokens=8)
    assert stop not in held.token_ids and len(held.token_ids) == 8 and held.finish_reason == "length"
    assert held.token_ids == _greedy(engine, 8, ignore_eos=True, stop_token_ids=[stop], min_tokens=8)


def test_repetition_penalty_equals_transformers_generate(client, model_name, llama_dir):
    [plain] = hf_greedy(llama_dir, [PROMPT_IDS], 16, ignore_eos=True)
    [ref] = hf_greedy(llama_dir, [PROMPT_IDS], 16, ignore_eos=True, repetition_penalty=0.5)
    assert ref.token_ids != plain.token_ids           # the penalty changes this greedy output
    choice, _ = _complete(client, model_name, 16, ignore_eos=True, repetition_penalty=0.5)
    assert_greedy_match(choice.token_ids, ref)


def _openai_penalized_greedy(folder, prompt: list[int], n: int, presence: float, frequency: float) -> list[int]:
    """transformers' logits, step by step, minus OpenAI's `count * frequency + (count > 0) * presence`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
            for t in set(out):
                logits[t] -= out.count(t) * frequency + presence
            out.append(int(logits.argmax()))
    return out


def test_presence_and_frequency_penalties_equal_the_openai_formula(client, model_name, llama_dir, engine):
    want = _openai_penalized_greedy(llama_dir, PROMPT_IDS, 16, -1.5, 0.5)
    assert want != _greedy(engine, 16, ignore_eos=True)
    choice, _ = _complete(client, model_name, 16, ignore_eos=True, presence_penalty=-1.5, frequency_penalty=0.5)
    assert choice.token_ids == want


def test_chat_carries_the_controls(client, model_name, engine):
    prompt_ids = engine.tokenizer.apply_chat_template(CHAT)
    params = dict(ignore_eos=True, repetition_penalty=0.6, frequency_penalty=0.5, presence_penalty=-1.0)
    [want] = engine.generate([prompt_ids], SamplingParams(max_tokens=10, **params))
    [plain] = engine.generate([prompt_ids], SamplingParams(max_tokens=10, ignore_eos=True))
    assert want.token_ids != plain.token_ids
    stream = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=10, temperature=0, stream=True,
        frequency_penalty=0.5, presence_penalty=-1.0,
        extra_body={**GREEDY, "repetition_penalty": 0.6})
    got = [t for chunk in stream for c in chunk.choices for t in (getattr(c, "token_ids", None) or [])]
    assert got == want.token_ids


def test_allowed_token_ids_confine_the_output(client, model_name, engine):
    plain = _greedy(engine, 8, ignore_eos=True)
    allowed = sorted({plain[1] + 1, plain[3] + 2, 7})      # not the greedy tokens
    choice, _ = _complete(client, model_name, 8, ignore_eos=True, allowed_token_ids=allowed)
    assert set(choice.token_ids) <= set(allowed) and choice.token_ids != plain
    assert choice.token_ids == _greedy(engine, 8, ignore_eos=True, allowed_token_ids=allowed)
    sampled = client.completions.create(model=model_name, prompt=PROMPT_IDS, max_tokens=8, temperature=1.5,
                                        seed=3, extra_body={"return_token_ids": True, "ignore_eos": True,
                                                            "allowed_token_ids": allowed})
    assert set(sampled.choices[0].token_ids) <= set(allowed)


def test_allowed_token_ids_outside_the_vocabulary_are_a_400(client, model_name, engine):
    vocab = engine.model_config.vocab_size
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids"):
        _complete(client, model_name, 2, allowed_token_ids=[vocab + 3])
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids"):
        _complete(client, model_name, 2, allowed_token_ids=[])


def test_bad_words_never_complete_in_the_output(client, model_name, engine):
    """A word the greedy output holds (as the tokenizer encodes it there) is banned: its tokens
    never appear in that order, and the output is the engine's with those sequences banned."""
    plain = _greedy(engine, 12, ignore_eos=True)
    word = engine.tokenizer.decode(plain[2:4])
    choice, _ = _complete(client, model_name, 12, ignore_eos=True, bad_words=[word])
    from splitserve.services.text.bad_words import bad_word_token_ids

    sequences = bad_word_token_ids(engine.tokenizer, [word])
    assert sequences and choice.token_ids != plain
    out = choice.token_ids
    for seq in sequences:
        assert not any(out[i:i + len(seq)] == seq for i in range(len(out)))
    assert out == _greedy(engine, 12, ignore_eos=True, bad_words=sequences)
    chat = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=4, temperature=0,
                                          extra_body={**GREEDY, "bad_words": [word]})
    assert chat.choices[0].finish_reason == "length"


def test_cache_salt_separates_prefix_cache_hits(client, model_name):
    prompt = [(7 * i + 3) % 30000 + 2 for i in range(70)]          # fresh: 4 full blocks of 16

    def cached(**extra) -> int:
        out = client.completions.create(model=model_name, prompt=prompt, max_tokens=2, temperature=0,
                                        extra_body={"ignore_eos": True, **extra})
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0                     # another salt: no shared blocks
    assert cached() == 0                                          # unsalted: nor these
    assert cached(cache_salt="tenant-a") == 64                    # same salt: its 4 blocks
    assert cached() == 64
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        cached(cache_salt="")


def _prompt_reference(engine, prompt: list[int], n: int):
    [r] = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=n))
    return r.prompt_logprobs


def test_prompt_logprobs_on_completions_and_chat(client, model_name, engine):
    want = _prompt_reference(engine, PROMPT_IDS, 2)
    out = client.completions.create(model=model_name, prompt=PROMPT_IDS, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    got = out.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(PROMPT_IDS) and got[0] is None
    for token_id, item, ref in zip(PROMPT_IDS[1:], got[1:], want):
        first = next(iter(item))                                   # the prompt token comes first
        assert first == str(token_id) and item[first]["rank"] == ref.rank
        assert item[first]["logprob"] == pytest.approx(ref.logprob, abs=1e-4)
        tops = {k: v for k, v in item.items() if v["rank"] <= 2}
        assert {int(k) for k in tops} >= set(ref.top_logprobs) - {token_id} and len(item) in (2, 3)
    prompt_ids = engine.tokenizer.apply_chat_template(CHAT)
    chat = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 0})
    got = chat.model_extra["prompt_logprobs"]
    assert len(got) == len(prompt_ids) and got[0] is None
    assert [next(iter(item)) for item in got[1:]] == [str(t) for t in prompt_ids[1:]]
    assert all(len(item) == 1 for item in got[1:])                # top 0: the prompt token only


def test_echo_with_logprobs_scores_the_echoed_prompt(client, model_name, engine):
    want = _prompt_reference(engine, PROMPT_IDS, 1)
    out = client.completions.create(model=model_name, prompt=PROMPT_IDS, max_tokens=3, temperature=0,
                                    echo=True, logprobs=1, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    n = len(PROMPT_IDS)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx([e.logprob for e in want], abs=1e-4)
    # vLLM's: the prompt token itself, then its top-1 (one entry when it is the top-1).
    assert all(token in t and len(t) in (1, 2) for token, t in zip(lp.tokens[1:n], lp.top_logprobs[1:n]))
    assert all(len(t) == 1 for t in lp.top_logprobs[n:])          # greedy: the chosen token is the top-1
    assert lp.text_offset == sorted(lp.text_offset)
    assert out.choices[0].text.startswith(engine.tokenizer.decode(PROMPT_IDS, skip_special_tokens=False))
    streamed = client.completions.create(model=model_name, prompt=PROMPT_IDS, max_tokens=3, temperature=0,
                                         echo=True, logprobs=1, stream=True, extra_body={"ignore_eos": True})
    values = [v for chunk in streamed for c in chunk.choices if c.logprobs for v in c.logprobs.token_logprobs]
    assert values[:n] == lp.token_logprobs[:n] and len(values) == n + 3
