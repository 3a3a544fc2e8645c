"""Workloads built from the real test tokenizer: exact lengths, shared prefixes,
Mooncake block sharing, ShareGPT parsing, seeded reproducibility."""

from __future__ import annotations

import json
import random

import pytest

from splitserve.errors import SplitserveError
from splitserve.loadgen import datasets, workloads
from splitserve.loadgen.workloads import LengthDist


def test_length_distributions():
    rng = random.Random(0)
    assert LengthDist.parse("32").sample(rng) == 32
    xs = [LengthDist.parse("uniform:10:20").sample(rng) for _ in range(200)]
    assert min(xs) >= 10 and max(xs) <= 20
    assert all(x >= 1 for x in (LengthDist.parse("normal:3:50").sample(rng) for _ in range(200)))
    assert LengthDist.parse("exp:8").describe() == "exp:8"
    for bad in ("abc", "uniform:1", "pareto:1:2"):
        with pytest.raises(SplitserveError):
            LengthDist.parse(bad)


def test_prompt_text_has_exactly_the_requested_tokens(llama_vocab):
    convs = workloads.synthetic(llama_vocab, 20, LengthDist.parse("uniform:1:300"), LengthDist.parse("8"), seed=3)
    for conv in convs:
        (turn,) = conv.turns
        assert llama_vocab.count(turn.text) == turn.num_tokens
        assert turn.max_tokens == 8


def test_workloads_are_seeded(llama_vocab):
    a = workloads.synthetic(llama_vocab, 3, LengthDist.parse("50"), LengthDist.parse("8"), seed=1)
    b = workloads.synthetic(llama_vocab, 3, LengthDist.parse("50"), LengthDist.parse("8"), seed=1)
    c = workloads.synthetic(llama_vocab, 3, LengthDist.parse("50"), LengthDist.parse("8"), seed=2)
    assert [x.turns[0].text for x in a] == [x.turns[0].text for x in b] != [x.turns[0].text for x in c]


def test_shared_prefix_tenants_share_exactly_their_prefix(llama_vocab):
    convs = workloads.shared_prefix(llama_vocab, num_tenants=3, prefix_len=40, questions_per_tenant=4,
                                    question_len=LengthDist.parse("10"), output_len=LengthDist.parse("5"))
    assert len(convs) == 12
    by_tenant: dict[str, list[list[int]]] = {}
    for conv in convs:
        ids = llama_vocab.encode(conv.turns[0].text)
        assert len(ids) == conv.turns[0].num_tokens == 50
        by_tenant.setdefault(conv.group, []).append(ids)
    prefixes = {tenant: ids[0][:40] for tenant, ids in by_tenant.items()}
    for tenant, prompts in by_tenant.items():
        assert all(p[:40] == prefixes[tenant] for p in prompts)
        assert len({tuple(p[40:]) for p in prompts}) == 4          # distinct questions
    assert len({tuple(p) for p in prefixes.values()}) == 3          # distinct tenants


def test_multi_turn_sessions(llama_vocab):
    convs = workloads.multi_turn(llama_vocab, 2, 3, LengthDist.parse("12"), LengthDist.parse("4"))
    assert [len(c.turns) for c in convs] == [3, 3]
    assert all(llama_vocab.count(t.text) == 12 for c in convs for t in c.turns)
    assert workloads.num_conversations_for(10, 3) == 4 and workloads.num_conversations_for(None, 3) == 1000


def _write_trace(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_blocks_share_content_exactly_when_hash_ids_match(llama_vocab, tmp_path):
    trace = _write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 1000, "input_length": 1500, "output_length": 700, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 1100, "output_length": 64, "hash_ids": [0, 1, 3]},
        {"timestamp": 4000, "input_length": 900, "output_length": 1, "hash_ids": [0, 5]},
        {"timestamp": 9000, "input_length": 600, "output_length": 10, "hash_ids": [6, 7]},
    ])
    w = datasets.mooncake_trace(llama_vocab, trace, block_tokens=16, time_scale=2.0, max_output_tokens=16)
    assert not w.cyclic and w.notes and "scaled" in w.notes[0]
    ids = [llama_vocab.encode(c.turns[0].text) for c in w.conversations]
    assert [len(x) for x in ids] == [47, 34, 28, 19] == [c.turns[0].num_tokens for c in w.conversations]
    assert ids[0][:32] == ids[1][:32] and ids[0][32:34] != ids[1][32:34]    # blocks 0, 1 shared; 2 vs 3 not
    assert ids[2][:16] == ids[0][:16] and ids[2][16:28] != ids[0][16:28]
    assert ids[3][:16] != ids[0][:16]
    assert [c.turns[0].max_tokens for c in w.conversations] == [16, 2, 1, 1]
    assert [c.arrival_s for c in w.conversations] == pytest.approx([0.0, 1.0, 6.0, 16.0])
    cut = datasets.mooncake_trace(llama_vocab, trace, block_tokens=16, max_input_tokens=30)
    cut_ids = [llama_vocab.encode(c.turns[0].text) for c in cut.conversations]
    assert [len(x) for x in cut_ids] == [30, 30, 28, 19] == [c.turns[0].num_tokens for c in cut.conversations]
    assert cut_ids[0] == ids[0][:30] and cut_ids[1] == ids[1][:30]          # the prefix kept, shared as before
    assert cut.params["prompts_cut"] == 2 and "2 prompt(s) cut to their first 30 tokens" in cut.notes[0]
    with pytest.raises(SplitserveError, match="--trace-max-input 0"):
        datasets.mooncake_trace(llama_vocab, trace, max_input_tokens=0)


def test_mooncake_conversations_replay_whole_conversations_in_trace_order(llama_vocab, tmp_path):
    trace = _write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [0, 1, 2]},      # A, turn 1
        {"timestamp": 10, "input_length": 600, "output_length": 10, "hash_ids": [0, 9, 10]},    # B, turn 1
        {"timestamp": 20, "input_length": 300, "output_length": 10, "hash_ids": [0]},           # no conversation
        {"timestamp": 30, "input_length": 900, "output_length": 10, "hash_ids": [0, 1, 2, 3]},  # A, turn 2
        {"timestamp": 40, "input_length": 600, "output_length": 10, "hash_ids": [0, 5, 6]},     # C, turn 1
        {"timestamp": 50, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2, 3, 4]},  # A, turn 3
        {"timestamp": 60, "input_length": 900, "output_length": 10, "hash_ids": [0, 9, 10, 11]},    # B, turn 2
        {"timestamp": 70, "input_length": 900, "output_length": 10, "hash_ids": [0, 5, 6, 7]},      # C, turn 2
    ])
    w = datasets.mooncake_trace(llama_vocab, trace, conversations=2, min_turns=2)
    assert [c.conversation_id for c in w.conversations] == ["trace0", "trace1", "trace3", "trace5", "trace6"]
    ids = {c.conversation_id: llama_vocab.encode(c.turns[0].text) for c in w.conversations}
    assert ids["trace5"][:len(ids["trace3"])] == ids["trace3"]        # a later turn repeats the earlier ones
    assert w.params["conversations"] == 2 and "first 2 conversations of 2+ turns" in w.notes[0]
    three = datasets.mooncake_trace(llama_vocab, trace, conversations=5, min_turns=3)
    assert [c.conversation_id for c in three.conversations] == ["trace0", "trace3", "trace5"]
    capped = datasets.mooncake_trace(llama_vocab, trace, conversations=3, min_turns=2, num_requests=4)
    assert [c.conversation_id for c in capped.conversations] == ["trace0", "trace1", "trace3", "trace4"]
    with pytest.raises(SplitserveError, match="no conversation of 4\\+ turns"):
        datasets.mooncake_trace(llama_vocab, trace, conversations=1, min_turns=4)


def test_mooncake_subset_and_missing_file(llama_vocab, tmp_path, monkeypatch):
    trace = _write_trace(tmp_path / "t.jsonl", [
        {"timestamp": t, "input_length": 100, "output_length": 10, "hash_ids": [t]} for t in range(5)])
    w = datasets.mooncake_trace(llama_vocab, trace, start=2, num_requests=2)
    assert [c.conversation_id for c in w.conversations] == ["trace2", "trace3"]
    with pytest.raises(SplitserveError, match="Mooncake trace not found at .*--trace"):
        datasets.mooncake_trace(llama_vocab, tmp_path / "missing.jsonl")
    monkeypatch.setenv(datasets.TRACE_ENV, str(trace))
    assert datasets.default_trace_path() == trace
    monkeypatch.delenv(datasets.TRACE_ENV)
    assert datasets.default_trace_path() == datasets.shipped_trace_path()   # unset: the shipped trace
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 1}\n')
    with pytest.raises(SplitserveError, match="not a Mooncake trace record"):
        datasets.mooncake_trace(llama_vocab, tmp_path / "bad.jsonl")


def test_sharegpt_file(llama_vocab, tmp_path):
    items = [
        {"id": "a", "conversations": [{"from": "human", "value": "What is the capital of France?"},
                                      {"from": "gpt", "value": "The capital of France is Paris."},
                                      {"from": "human", "value": "And of Italy?"},
                                      {"from": "gpt", "value": "Rome."}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "starts with the model"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "word " * 3000},
                                      {"from": "gpt", "value": "too long a prompt"}]},
        {"id": "d", "conversations": [{"from": "user", "value": "Hi there"},
                                      {"from": "assistant", "value": "Hello! " * 200}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(items))
    w = datasets.sharegpt(llama_vocab, path, max_turns=2, max_output_tokens=50)
    by_id = {c.group: c for c in w.conversations}
    assert set(by_id) == {"a", "d"}
    a = by_id["a"]
    assert [t.text for t in a.turns] == ["What is the capital of France?", "And of Italy?"]
    assert a.turns[0].num_tokens == llama_vocab.count("What is the capital of France?")
    assert a.turns[0].max_tokens == llama_vocab.count("The capital of France is Paris.")
    assert by_id["d"].turns[0].max_tokens == 50
    assert len(datasets.sharegpt(llama_vocab, path).conversations[0].turns) == 1
    path.write_text("{}")
    with pytest.raises(SplitserveError, match="JSON list"):
        datasets.sharegpt(llama_vocab, path)
