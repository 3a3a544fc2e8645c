"""The in-place paged decode kernel equals the gather path on random pools.

Block tables scatter each sequence over random, non-adjacent blocks of a pool whose
other blocks hold noise (a kernel that read a wrong block or past a sequence's end
would pick it up); lengths cover partial last blocks and single tokens; grouped-query
ratios, sliding windows and the three cache dtypes are exercised.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from splitserve.errors import InvalidRequestError
from splitserve.services.engine.kv_cache import KVCache
from splitserve.services.engine.model.paged_attention import (
    GatherAttention, PagedAttention, make_decode_attention)

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _case(lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) * 2 + 4
    kv = KVCache(3, num_blocks, block_size, kv_heads, head_dim, dtype, torch.device("cpu"))
    kv.tensor.copy_(torch.randn(kv.tensor.shape, generator=gen))
    order = torch.randperm(num_blocks, generator=gen)
    width = max(-(-n // block_size) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    used = 0
    for row, n in enumerate(lens):
        count = -(-n // block_size)
        tables[row, :count] = order[used:used + count]
        used += count
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    return q, kv, tables, torch.tensor(lens, dtype=torch.long)


def _compare(lens, heads, kv_heads, head_dim, block_size, dtype, window, seed=0):
    q, kv, tables, ctx = _case(lens, heads, kv_heads, head_dim, block_size, dtype, seed)
    want = GatherAttention(heads, kv_heads, head_dim ** -0.5, window)(1, q, kv, tables, ctx)
    got = PagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5, window)(1, q, kv, tables, ctx)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mixed_lengths_match_gather(dtype):
    _compare([1, 15, 16, 17, 300], heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=dtype, window=None)


def test_sliding_window_matches_gather():
    _compare([5, 40, 100], heads=4, kv_heads=2, head_dim=32, block_size=8, dtype=torch.float32, window=20)


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 80), min_size=1, max_size=6),
       kv_heads=st.sampled_from([1, 2, 4]), groups=st.sampled_from([1, 2, 3, 8]),
       head_dim=st.sampled_from([8, 64, 72, 128]), block_size=st.sampled_from([1, 4, 16]),
       window=st.one_of(st.none(), st.integers(1, 50)), seed=st.integers(0, 2**16))
def test_random_shapes_match_gather(lens, kv_heads, groups, head_dim, block_size, window, seed):
    _compare(lens, kv_heads * groups, kv_heads, head_dim, block_size, torch.float32, window, seed)


def test_kernel_reads_only_its_own_blocks():
    """Poisoning every block outside the tables (NaN) leaves the output finite and unchanged."""
    q, kv, tables, ctx = _case([20, 33], 6, 2, 16, 8, torch.float32, seed=1)
    attention = PagedAttention(6, 2, 16, 0.25, None)
    before = attention(0, q, kv, tables, ctx)
    owned = set(tables.flatten().tolist())
    for block in range(kv.num_blocks):
        if block not in owned:
            kv.tensor[:, :, block] = float("nan")
    # The tail of each last block is past the sequence's end: poison it too.
    for row, n in enumerate(ctx.tolist()):
        last, used = tables[row, (n - 1) // 8], n % 8
        if used:
            kv.tensor[:, :, last, used:] = float("nan")
    after = attention(0, q, kv, tables, ctx)
    assert torch.isfinite(after).all()
    torch.testing.assert_close(after, before, atol=0, rtol=0)


def test_a_head_dim_the_kernel_does_not_take_falls_back_on_auto():
    cpu = torch.device("cpu")
    assert make_decode_attention("auto", cpu, 4, 2, 20, 1.0, None).name == "gather"
    with pytest.raises(InvalidRequestError, match="multiple of 8"):
        make_decode_attention("paged", cpu, 4, 2, 20, 1.0, None)


def test_backend_choice():
    cpu = torch.device("cpu")
    assert make_decode_attention("auto", cpu, 4, 2, 16, 1.0, None).name == "paged"
    assert make_decode_attention("gather", cpu, 4, 2, 16, 1.0, None).name == "gather"
    assert make_decode_attention("auto", torch.device("cuda"), 4, 2, 16, 1.0, None).name == "gather"
    with pytest.raises(InvalidRequestError, match="CPU only"):
        make_decode_attention("paged", torch.device("cuda"), 4, 2, 16, 1.0, None)
    with pytest.raises(InvalidRequestError, match="choose one of"):
        make_decode_attention("flash", cpu, 4, 2, 16, 1.0, None)


def test_no_compiler_falls_back_to_gather_on_auto_and_refuses_paged(monkeypatch, tmp_path):
    from splitserve.services.engine.kernels import build

    monkeypatch.setenv("SPLITSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    build.load.cache_clear()
    try:
        cpu = torch.device("cpu")
        assert make_decode_attention("auto", cpu, 4, 2, 16, 1.0, None).name == "gather"
        with pytest.raises(InvalidRequestError, match="unavailable here"):
            make_decode_attention("paged", cpu, 4, 2, 16, 1.0, None)
    finally:
        build.load.cache_clear()
