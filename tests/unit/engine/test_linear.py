"""Linear picks oneDNN's packed GEMM or F.linear per shape and row count by measuring, once per machine."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from splitserve.services.engine.model import linear
from splitserve.services.engine.model.linear import MEASURED_ROWS, PACKED_MAX_ROWS, Linear


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPLITSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("SPLITSERVE_GEMM", raising=False)
    monkeypatch.setattr(linear, "_choices", None)
    return tmp_path


def test_the_measured_choice_is_cached_and_shared(fresh_cache, monkeypatch):
    w, b = torch.randn(96, 64), torch.randn(96)
    first = Linear(w, b)
    [cache] = list(fresh_cache.glob("gemm-*.json"))
    table = json.loads(cache.read_text())
    assert table == {"96x64:torch.float32:True": list(first._packed_wins)}
    # A second process (fresh in-memory table) reads the file instead of measuring again.
    monkeypatch.setattr(linear, "_choices", None)
    monkeypatch.setattr(linear, "_measure", lambda *a: pytest.fail("measured twice"))
    assert Linear(w, b)._packed_wins == first._packed_wins


@pytest.mark.parametrize("mode", ["packed", "plain"])
def test_either_kernel_computes_the_same_product(fresh_cache, monkeypatch, mode):
    monkeypatch.setenv("SPLITSERVE_GEMM", mode)
    w, b = torch.randn(80, 48), torch.randn(80)
    lin = Linear(w, b)
    assert lin.packed == (mode == "packed")
    for rows in (1, 3, 17, 64, 200, PACKED_MAX_ROWS + 5):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert not lin.uses_packed(PACKED_MAX_ROWS + 1)


def test_rows_take_the_nearest_measured_bucket_at_or_above(fresh_cache, monkeypatch):
    wins = (True, False, True, False)
    assert len(wins) == len(MEASURED_ROWS)
    monkeypatch.setattr(linear, "_measure", lambda *a: wins)
    lin = Linear(torch.randn(32, 16))
    assert [lin.uses_packed(r) for r in (1, 2, 4, 5, 16, 17, 64, 256, 257)] == [
        True, False, False, True, True, False, False, False, False]


def test_a_shape_where_plain_always_wins_keeps_no_packed_copy(fresh_cache, monkeypatch):
    monkeypatch.setattr(linear, "_measure", lambda *a: (False,) * len(MEASURED_ROWS))
    assert not Linear(torch.randn(32, 16)).packed
