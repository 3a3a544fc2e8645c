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
