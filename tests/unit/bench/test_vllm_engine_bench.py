"""bench/vllm_engine.py: both contenders get the same vLLM, weights and engine flags, and each
ratio pairs runs of the same round and concurrency."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))

import vllm_engine  # noqa: E402
from peers import RunResult  # noqa: E402


def _run(server: str, round_: int, conc: int, tok_s: float, ttft: float) -> RunResult:
    return RunResult(server=server, client="splitserve-bench", round=round_, input_len=256, output_len=128,
                     concurrency=conc, requests=4, completed=4, errors=0, duration_s=10.0,
                     output_tokens_per_s=tok_s, ttft_p50_s=ttft, ttft_p99_s=ttft, itl_p50_s=0.1, itl_p99_s=0.1,
                     foreign_cores=0.0, server_cores=1.0, client_cores=0.1, loadavg_1m=0.5, attempt=0)


def test_both_servers_get_the_same_vllm_the_same_weights_and_the_same_engine_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("SPLITSERVE_VLLM_PYTHON", str(tmp_path / "env" / "bin" / "python"))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    flags = ["--max-model-len", "2048", "--enforce-eager"]
    ours, ours_env = vllm_engine.serve_command("splitserve-vllm", 8000, flags, 1, workers=2, router="round-robin")
    theirs, theirs_env = vllm_engine.serve_command("vllm", 8001, flags, 1)
    assert theirs[0] == str(tmp_path / "env" / "bin" / "vllm")
    assert ours[ours.index("--engine-python") + 1] == str(tmp_path / "env" / "bin" / "python")
    assert ours[ours.index("--") + 1:] == flags and theirs[-len(flags):] == flags
    assert theirs[2] == str(vllm_engine.shipped_model_dir()) and ours[ours.index("--model") + 1] == "smollm2"
    assert ours[ours.index("--workers") + 1] == "2" and ours[ours.index("--router") + 1] == "round-robin"
    assert ours_env["VLLM_CPU_KVCACHE_SPACE"] == theirs_env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    # vLLM's own server keeps its EngineCore process; splitserve's worker runs vLLM in-process itself.
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in theirs_env


def test_ratios_pair_runs_of_the_same_round_and_concurrency():
    results = [_run("vllm", 1, 1, 10.0, 1.0), _run("splitserve-vllm", 1, 1, 9.0, 1.2),
               _run("vllm", 2, 1, 8.0, 2.0), _run("splitserve-vllm", 2, 1, 8.0, 1.0),
               _run("vllm", 1, 4, 20.0, 1.0), _run("splitserve-vllm", 1, 4, 30.0, 0.5)]
    ratios = vllm_engine.cost_ratios(results)
    assert ratios["tok_s"] == {"1": [pytest.approx(0.9), pytest.approx(1.0)], "4": [pytest.approx(1.5)]}
    assert ratios["ttft_p50"] == {"1": [pytest.approx(1.2), pytest.approx(0.5)], "4": [pytest.approx(0.5)]}


def _trace(tmp_path: Path, monkeypatch, records: list[dict]) -> None:
    import json
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "output_length": 64, **r}) + "\n"
                            for i, r in enumerate(records)))
    monkeypatch.setenv("SPLITSERVE_MOONCAKE_TRACE", str(path))


def test_best_cached_tokens_is_what_one_unbounded_cache_holds_in_whole_blocks(tmp_path, monkeypatch):
    # Two conversations of two turns (records sharing their first two trace blocks), a stray record
    # between them; 16 tokens per trace block (input x 16/512), vLLM blocks of 32 tokens.
    _trace(tmp_path, monkeypatch, [
        {"input_length": 512 * 3, "hash_ids": [1, 2, 3]},             # a's first turn: 48 tokens, nothing before
        {"input_length": 512 * 2, "hash_ids": [1, 9]},                # b's first turn: shares block 1 (16 tokens)
        {"input_length": 512 * 2, "hash_ids": [7, 8]},                # one turn only: not replayed
        {"input_length": 512 * 5, "hash_ids": [1, 2, 3, 4, 5]},       # a again: 48 tokens held -> 32 (whole blocks)
        {"input_length": 512 * 2, "hash_ids": [1, 9]},                # b again, the same prompt: all but its last token
    ])
    import argparse
    args = argparse.Namespace(trace_conversations=2, trace_min_turns=2, trace_block_tokens=16, kv_block_size=32,
                              trace_max_input=1800, trace_requests=None)
    assert vllm_engine.best_cached_tokens(args) == {"trace0": 0, "trace1": 0, "trace3": 32, "trace4": 0}
    args.kv_block_size = 16
    assert vllm_engine.best_cached_tokens(args) == {"trace0": 0, "trace1": 16, "trace3": 48, "trace4": 16}
    args.trace_requests = 2
    assert vllm_engine.best_cached_tokens(args) == {"trace0": 0, "trace1": 16}


def test_slowest_tenth_counts_who_had_all_the_cache_any_routing_could_give():
    def req(i: int, ttft: float, prompt: int, cached: int) -> dict:
        return {"conversation_id": f"trace{i}", "ok": True, "ttft_s": ttft, "prompt_tokens": prompt,
                "cached_tokens": cached}
    result = {"summary": {"ttft_s": {"p90": 2.0}},
              "requests": [req(0, 3.0, 500, 0), req(1, 2.5, 400, 64), req(2, 2.0, 300, 288), req(3, 0.2, 300, 0),
                           {"conversation_id": "trace4", "ok": False, "ttft_s": None, "prompt_tokens": 9,
                            "cached_tokens": None}]}
    best = {"trace0": 0, "trace1": 320, "trace2": 288, "trace3": 256}
    assert vllm_engine.slowest_tenth(result, best) == {"requests": 3, "routing_optimal": 2,
                                                       "uncached_tokens": [12, 336, 500]}
