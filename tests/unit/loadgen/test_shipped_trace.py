"""The Mooncake trace ships inside splitserve.loadgen: found without a path, unmodified
(its checksum is the one its attribution note states), with its license note beside
it, and declared as package data so a wheel (a non-editable install) carries it."""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import tomllib
from pathlib import Path

from splitserve.loadgen import datasets

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_the_trace_is_found_without_a_path(llama_vocab, monkeypatch):
    monkeypatch.delenv(datasets.TRACE_ENV, raising=False)
    shipped = datasets.shipped_trace_path()
    assert shipped.is_file() and shipped.name == "conversation_trace.jsonl"
    workload = datasets.mooncake_trace(llama_vocab, num_requests=3, block_tokens=8)
    assert workload.params["path"] == str(shipped)
    assert [c.conversation_id for c in workload.conversations] == ["trace0", "trace1", "trace2"]
    # the first two requests share their first block (hash id 0), then differ (ids 1 and 14)
    first, second = (c.turns[0].text for c in workload.conversations[:2])
    common = os.path.commonprefix([first, second])
    assert len(common) >= 8 and common != first and common != second


def test_the_override_still_wins(llama_vocab, tmp_path, monkeypatch):
    other = tmp_path / "mine.jsonl"
    other.write_text('{"timestamp": 0, "input_length": 64, "output_length": 4, "hash_ids": [7]}\n')
    monkeypatch.setenv(datasets.TRACE_ENV, str(other))
    assert datasets.mooncake_trace(llama_vocab, block_tokens=8).params["path"] == str(other)


def test_the_trace_is_unmodified_and_attributed():
    shipped = datasets.shipped_trace_path()
    note = (shipped.parent / "README.md").read_text(encoding="utf-8")
    assert "Apache License 2.0" in note and "kvcache-ai/Mooncake" in note and "unmodified" in note
    stated = re.search(r"sha256 `([0-9a-f]{64})`", note).group(1)
    assert hashlib.sha256(shipped.read_bytes()).hexdigest() == stated


def test_package_data_covers_every_shipped_file():
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        setuptools_table = tomllib.load(f)["tool"]["setuptools"]
    folder = REPO_ROOT / setuptools_table["package-dir"]["splitserve.loadgen"]
    patterns = setuptools_table["package-data"]["splitserve.loadgen"]
    shipped = [p.relative_to(folder).as_posix() for p in (folder / "data").rglob("*") if p.is_file()]
    assert "data/mooncake/conversation_trace.jsonl" in shipped
    uncovered = [name for name in shipped if not any(fnmatch.fnmatch(name, pat) for pat in patterns)]
    assert not uncovered, f"files under loadgen/data/ a wheel would leave out: {uncovered}"


def test_bench_replays_every_request_of_the_chosen_conversations():
    """`splitserve bench --workload trace --trace-conversations K`: bounded by the conversations'
    requests (no --num-requests), each later turn repeating its conversation's earlier ones."""
    from splitserve.loadgen.cli import build_run_parser
    from splitserve.loadgen.options import build_spec

    args = build_run_parser().parse_args(["--url", "http://127.0.0.1:9", "--model", "smollm2",
                                      "--tokenizer", "smollm2", "--workload", "trace", "--trace-conversations", "2",
                                      "--trace-min-turns", "3"])
    spec = build_spec(args)
    requests = spec.workload.conversations
    assert spec.limits.max_requests == len(requests) >= 6 and spec.workload.params["conversations"] == 2
    texts = [c.turns[0].text for c in requests]
    assert sum(any(t.startswith(os.path.commonprefix([t, u])) and len(os.path.commonprefix([t, u])) > 100
                   for u in texts[:i]) for i, t in enumerate(texts)) >= len(texts) - 2   # later turns repeat earlier
