"""splitserve.testing: the random test checkpoints, the greedy oracle and the bounded wait.

The engine's correctness tests lean on the first two, so they are checked here: the
checkpoints have the features they claim (bias, QK-norm, tying, RoPE variants),
are deterministic, load in transformers, decode non-degenerately, and the
tokenizer encodes exactly like the SentencePiece model it came from. The
comparison rule itself is checked on hand-made references. Every wait of the
suite is `wait_until`: what it returns, and what its timeout says.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
from pathlib import Path

import jinja2
import pytest
import torch
from safetensors import safe_open

from splitserve.testing import GreedyReference, assert_greedy_match, build_random_model, hf_greedy
from splitserve.testing.models import CHAT_TEMPLATE, EOS_TOKEN_ID, random_prompt, sentencepiece_model_path
from splitserve.testing.waiting import WaitTimeout, async_wait_until, wait_until

ARCH_FIXTURES = ["llama_dir", "mistral_dir", "qwen2_dir", "qwen3_dir"]
TEXTS = [
    "Hello world! What is the capital of France?",
    "  two leading spaces,  double  spaces and trailing  ",
    "line one\nline two\ttab\n\n",
    "naïve café, 日本語, emoji 🙂, digits 1234567",
    "def f(x):\n    return x ** 2\n",
    "",
]


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


# --- checkpoints ---------------------------------------------------------------


@pytest.mark.parametrize("fixture", ARCH_FIXTURES)
def test_checkpoint_has_design_shape(request, fixture):
    folder = request.getfixturevalue(fixture)
    for name in ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]:
        assert (folder / name).is_file(), name
    config = _config(folder)
    expected = {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "eos_token_id": 2,
    }
    assert {key: config[key] for key in expected} == expected
    assert config["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    tensors = _tensors(folder)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert tensors["model.embed_tokens.weight"].shape == (32000, 256)
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2


def test_llama_has_untied_lm_head(llama_dir):
    tensors = _tensors(llama_dir)
    assert _config(llama_dir)["tie_word_embeddings"] is False
    assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])


def test_qwen2_ties_embeddings_and_has_nonzero_qkv_bias(qwen2_dir):
    tensors = _tensors(qwen2_dir)
    assert _config(qwen2_dir)["tie_word_embeddings"] is True
    assert "lm_head.weight" not in tensors
    for proj in ["q_proj", "k_proj", "v_proj"]:
        bias = tensors[f"model.layers.0.self_attn.{proj}.bias"]
        assert bias.abs().mean() > 0.02, proj
    assert "model.layers.0.self_attn.o_proj.bias" not in tensors


def test_qwen3_has_random_qk_norm(qwen3_dir):
    tensors = _tensors(qwen3_dir)
    for norm in ["q_norm", "k_norm"]:
        weight = tensors[f"model.layers.0.self_attn.{norm}.weight"]
        assert weight.shape == (32,)
        assert 0.8 < weight.mean() < 1.2 and weight.std() > 0.05, norm


def test_builds_are_deterministic_per_seed_and_arch(tmp_path, llama_dir, mistral_dir):
    again = build_random_model("llama", tmp_path / "again", seed=0)
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]:
        assert (again / name).read_bytes() == (llama_dir / name).read_bytes(), name
    other_seed = build_random_model("llama", tmp_path / "seed1", seed=1, num_hidden_layers=1)
    first_layer = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(_tensors(other_seed)[first_layer], _tensors(llama_dir)[first_layer])
    # llama and mistral have the same tensor names and shapes; the arch salts the seed.
    assert not torch.equal(_tensors(mistral_dir)[first_layer], _tensors(llama_dir)[first_layer])


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, {"rope_type": "linear", "factor": 2.0}),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, {"rope_type": "linear", "factor": 2.0}),
        (
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 1024,
                }
            },
            {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0},
        ),
    ],
)
def test_rope_overrides_are_written_as_rope_parameters(tmp_path, overrides, expected):
    folder = build_random_model("llama", tmp_path / "rope", num_hidden_layers=1, **overrides)
    config = _config(folder)
    written = config["rope_parameters"]
    assert {key: written[key] for key in expected} == expected
    assert written.get("rope_theta") == expected.get("rope_theta", 10000.0)
    assert config.get("rope_scaling") is None and config.get("rope_theta") is None


def test_unknown_arch_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown arch"):
        build_random_model("gpt2", tmp_path)


# --- tokenizer -----------------------------------------------------------------


def test_tokenizer_json_encodes_like_sentencepiece_and_round_trips(llama_dir):
    import sentencepiece
    from tokenizers import Tokenizer

    sp = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model_path()))
    tokenizer = Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 32000
    assert [tokenizer.token_to_id(t) for t in ["<unk>", "<s>", "</s>"]] == [0, 1, 2]
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        assert ids == [1, *sp.encode(text)], text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_transformers_tokenizer_and_chat_template(qwen3_dir):
    from transformers import PreTrainedTokenizerFast

    # Not AutoTokenizer: for model_type qwen2 transformers 5 forces its byte-level
    # Qwen2Tokenizer whatever tokenizer_config.json says.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(qwen3_dir)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer(TEXTS[1]).input_ids[0] == 1
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    expected = "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello.</s>[INST] Bye [/INST]"
    assert tokenizer.apply_chat_template(messages, tokenize=False) == expected
    # Plain jinja2 renders it the same, with or without HF's whitespace settings.
    for env in [jinja2.Environment(), jinja2.Environment(trim_blocks=True, lstrip_blocks=True)]:
        template = env.from_string(CHAT_TEMPLATE)
        assert template.render(messages=messages, bos_token="<s>", eos_token="</s>") == expected
        assert template.render(messages=messages[1:2], bos_token="<s>", eos_token="</s>") == "<s>[INST] Hi [/INST]"


# --- oracle --------------------------------------------------------------------

PROMPTS = [[1, 22557, 1526, 28808, 1824, 349, 272, 5565, 302, 4843, 28804], [1, 415, 2936, 9060, 285, 1142]]


@pytest.mark.parametrize("fixture", ARCH_FIXTURES)
def test_hf_greedy_is_varied_and_reports_one_gap_per_token(request, fixture):
    refs = hf_greedy(request.getfixturevalue(fixture), PROMPTS, 24, ignore_eos=True)
    assert len(refs) == len(PROMPTS)
    for ref, prompt in zip(refs, PROMPTS):
        assert ref.prompt_ids == prompt
        assert len(ref.token_ids) == len(ref.top2_gaps) == 24
        assert all(gap >= 0.0 for gap in ref.top2_gaps)
        # Not degenerate: a random model that repeats one token would let a broken engine pass.
        assert len(set(ref.token_ids)) >= 16, ref.token_ids
        assert max(len(list(run)) for _, run in itertools.groupby(ref.token_ids)) <= 3, ref.token_ids


def test_hf_greedy_stops_at_eos_unless_ignored(tmp_path, llama_dir):
    free = hf_greedy(llama_dir, PROMPTS[:1], 8, ignore_eos=True)[0]
    # Make the 4th generated token the EOS of a copy of the checkpoint.
    folder = tmp_path / "eos"
    shutil.copytree(llama_dir, folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    generation["eos_token_id"] = free.token_ids[3]
    (folder / "generation_config.json").write_text(json.dumps(generation))
    stopped = hf_greedy(folder, PROMPTS[:1], 8)[0]
    assert stopped.token_ids == free.token_ids[:4] and stopped.stopped_at_eos
    assert len(stopped.top2_gaps) == 4
    ignored = hf_greedy(folder, PROMPTS[:1], 8, ignore_eos=True)[0]
    assert len(ignored.token_ids) == 8 and free.token_ids[3] not in ignored.token_ids
    assert ignored.token_ids[:3] == free.token_ids[:3] and not ignored.stopped_at_eos


def test_random_prompt_is_seeded_and_holds_no_special_token():
    prompt = random_prompt(5, 500)
    assert prompt == random_prompt(5, 500) and len(prompt) == 500
    assert random_prompt(6, 500)[:16] != prompt[:16]
    assert EOS_TOKEN_ID < min(prompt) and max(prompt) < 32000


# --- comparison rule -----------------------------------------------------------


def _ref(token_ids: list[int], gaps: list[float]) -> GreedyReference:
    return GreedyReference(token_ids=token_ids, top2_gaps=gaps)


def test_identical_sequences_match():
    assert assert_greedy_match([5, 6, 7], _ref([5, 6, 7], [0.5, 0.5, 0.5])) == 3


def test_difference_at_a_clear_position_fails_with_details():
    with pytest.raises(AssertionError, match=r"position 1: ours 9, reference 6.*gap 0\.5"):
        assert_greedy_match([5, 9, 7], _ref([5, 6, 7], [0.5, 0.5, 0.5]))


def test_difference_at_a_tie_stops_the_comparison():
    # Everything after a tie may differ.
    assert assert_greedy_match([5, 9, 1, 2], _ref([5, 6, 7, 8], [0.5, 1e-4, 0.5, 0.5])) == 1


def test_tie_tolerance_is_strict_and_adjustable():
    ref = _ref([5, 6], [0.5, 0.01])
    with pytest.raises(AssertionError):
        assert_greedy_match([5, 9], ref)
    with pytest.raises(AssertionError):
        assert_greedy_match([5, 9], ref, tie_tolerance=0.01)
    assert assert_greedy_match([5, 9], ref, tie_tolerance=0.02) == 1


def test_a_small_gap_where_tokens_agree_changes_nothing():
    with pytest.raises(AssertionError, match="position 2"):
        assert_greedy_match([5, 6, 0], _ref([5, 6, 7], [0.5, 1e-6, 0.5]))


@pytest.mark.parametrize("ours", [[5, 6], [5, 6, 7, 2]])
def test_length_mismatch_fails(ours):
    with pytest.raises(AssertionError, match="length mismatch"):
        assert_greedy_match(ours, _ref([5, 6, 7], [0.5, 0.5, 0.5]))


def test_sample_sum_adds_the_samples_whose_labels_match():
    from splitserve.testing.metrics import sample_sum

    text = ('# HELP splitserve_migrations_total x\n'
            'splitserve_migrations_total{outcome="migrated"} 3.0\n'
            'splitserve_migrations_total{outcome="retried"} 1.0\n'
            'splitserve_migrations_total_created{outcome="migrated"} 17.0\n'
            'splitserve_process_restarts 2.0\n')
    assert sample_sum(text, "splitserve_migrations_total") == 4.0
    assert sample_sum(text, "splitserve_migrations_total", outcome="migrated") == 3.0
    assert sample_sum(text, "splitserve_migrations_total", outcome="refused_limit") == 0.0
    assert sample_sum(text, "splitserve_process_restarts") == 2.0


# --- waiting for a condition ---------------------------------------------------


def test_wait_until_returns_the_first_truthy_value():
    answers = iter([None, 0, "", "ready", "later"])
    looks = []

    def predicate():
        looks.append(1)
        return next(answers)

    assert wait_until(predicate, timeout=5, what="the answer", interval=0) == "ready"
    assert len(looks) == 4


def test_wait_until_names_what_did_not_happen_and_the_last_value():
    with pytest.raises(WaitTimeout) as timed_out:
        wait_until(lambda: [], timeout=0, what="the queue to fill", details=lambda: "queue log: empty")
    assert isinstance(timed_out.value, AssertionError) and isinstance(timed_out.value, TimeoutError)
    message = str(timed_out.value)
    assert message.startswith("timed out after 0 s waiting for the queue to fill (last value: [])")
    assert message.endswith("\nqueue log: empty")


def test_wait_until_shortens_a_long_last_value_and_survives_failing_details():
    class NotYet:
        def __bool__(self) -> bool:
            return False

        def __repr__(self) -> str:
            return "pending " * 1000

    with pytest.raises(WaitTimeout) as timed_out:
        wait_until(NotYet, timeout=0, what="the batch", details=lambda: 1 / 0)
    first_line, details = str(timed_out.value).split("\n")
    assert len(first_line) < 700 and first_line.endswith(" ...)")
    assert details == "(details unavailable: ZeroDivisionError('division by zero'))"


def test_an_exception_from_the_predicate_ends_the_wait():
    looks = []

    def exited():
        looks.append(1)
        raise AssertionError("the process exited")

    with pytest.raises(AssertionError, match="the process exited"):
        wait_until(exited, timeout=60, what="a line")
    assert len(looks) == 1


def test_async_wait_until_lets_the_loop_run_between_looks():
    async def main():
        done = []
        asyncio.get_running_loop().call_soon(done.append, "finished")      # runs only once the wait yields
        return await async_wait_until(lambda: done, timeout=5, what="the callback", interval=0)

    assert asyncio.run(main()) == ["finished"]


def test_async_wait_until_awaits_a_coroutine_predicate_and_times_out_like_the_sync_one():
    async def main():
        looks = []

        async def third_look():
            looks.append(1)
            return len(looks) if len(looks) == 3 else None

        found = await async_wait_until(third_look, timeout=5, what="the third look", interval=0)
        with pytest.raises(WaitTimeout, match=r"waiting for a reply \(last value: None\)\nno reply"):
            await async_wait_until(lambda: None, timeout=0, what="a reply", details=lambda: "no reply")
        return found

    assert asyncio.run(main()) == 3
