"""The in-place paged decode kernels (C++ on CPU, Triton for CUDA) equal the gather path on random pools.

Block tables scatter each sequence over random, non-adjacent blocks of a pool whose
other blocks hold noise (a kernel that read a wrong block or past a sequence's end
would pick it up); lengths cover partial last blocks and single tokens; grouped-query
ratios, sliding windows and the three cache dtypes are exercised. The Triton kernel runs
here under Triton's interpreter (TRITON_INTERPRET=1, on CPU tensors): the same kernel source
the GPU compiles, checked on machines without one; `scripts/gpu-check.sh` runs it compiled.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from splitserve.errors import InvalidRequestError
from splitserve.services.engine.kv_cache import KVCache
from splitserve.services.engine.model.paged_attention import (
    GatherAttention, PagedAttention, make_decode_attention)
from splitserve.services.engine.model.triton_paged_attention import TritonPagedAttention

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _case(lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int, dtype, seed: int,
          device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) * 2 + 4
    kv = KVCache(3, num_blocks, block_size, kv_heads, head_dim, dtype, torch.device(device))
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
    return q.to(device), kv, tables.to(device), torch.tensor(lens, dtype=torch.long, device=device)


def _compare(lens, heads, kv_heads, head_dim, block_size, dtype, window, seed=0, kernel=PagedAttention,
             device="cpu"):
    q, kv, tables, ctx = _case(lens, heads, kv_heads, head_dim, block_size, dtype, seed, device)
    want = GatherAttention(heads, kv_heads, head_dim ** -0.5, window)(1, q, kv, tables, ctx)
    got = kernel(heads, kv_heads, head_dim, head_dim ** -0.5, window)(1, q, kv, tables, ctx)
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
    # On CUDA both name the Triton kernel (it compiles at its first call, so this needs no GPU).
    for backend in ("auto", "paged"):
        chosen = make_decode_attention(backend, torch.device("cuda"), 4, 2, 16, 1.0, None)
        assert isinstance(chosen, TritonPagedAttention) and chosen.name == "paged"
    assert make_decode_attention("auto", torch.device("meta"), 4, 2, 16, 1.0, None).name == "gather"
    with pytest.raises(InvalidRequestError, match="no in-place kernel for meta"):
        make_decode_attention("paged", torch.device("meta"), 4, 2, 16, 1.0, None)
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


# -- the Triton kernel (CUDA's in-place path), interpreted on CPU -----------------------------
# Triton picks its interpreter when it is imported (its own helpers, tl.sum among them, are
# jitted then), and this test session imports it early; so the interpreted cases run in a
# child process started with TRITON_INTERPRET=1 (this file's __main__).
TRITON_CASES = [   # lens, heads, kv_heads, head_dim, block_size, dtype, window
    ([1, 15, 16, 17, 300], 9, 3, 64, 16, "float32", None),
    ([1, 15, 16, 17, 300], 9, 3, 64, 16, "bfloat16", None),
    ([1, 15, 16, 17, 300], 9, 3, 64, 16, "float16", None),
    ([5, 40, 100], 4, 2, 32, 8, "float32", 20),       # sliding window starting inside a block
    ([7, 1], 2, 2, 72, 1, "float32", None),           # head_dim not a power of two; one-token blocks
    ([33, 64], 8, 1, 16, 4, "float32", 16),           # 8 query heads on one KV head; window of 4 blocks
]


def _triton_cases(device: str = "cpu") -> int:
    for lens, heads, kv_heads, head_dim, block_size, dtype, window in TRITON_CASES:
        _compare(lens, heads, kv_heads, head_dim, block_size, getattr(torch, dtype), window, seed=3,
                 kernel=TritonPagedAttention, device=device)
    # Poison every block outside the tables: the output must not move.
    q, kv, tables, ctx = _case([20, 33], 6, 2, 16, 8, torch.float32, seed=1, device=device)
    attention = TritonPagedAttention(6, 2, 16, 0.25, None)
    before = attention(0, q, kv, tables, ctx)
    owned = set(tables.flatten().tolist())
    kv.tensor[:, :, [b for b in range(kv.num_blocks) if b not in owned]] = float("nan")
    torch.testing.assert_close(attention(0, q, kv, tables, ctx), before, atol=0, rtol=0)
    return len(TRITON_CASES) + 1


def test_triton_kernel_matches_gather_interpreted():
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.split()[-2:] == ["checked", str(len(TRITON_CASES) + 1)]


@pytest.mark.gpu
def test_triton_kernel_matches_gather_compiled_on_cuda():
    assert _triton_cases("cuda") == len(TRITON_CASES) + 1


def test_triton_auto_falls_back_to_gather_and_paged_refuses(caplog):
    q, kv, tables, ctx = _case([10, 30], 4, 2, 16, 6, torch.float32, seed=2)     # block size 6
    want = GatherAttention(4, 2, 0.25, None)(0, q, kv, tables, ctx)
    auto = TritonPagedAttention(4, 2, 16, 0.25, None, fallback=GatherAttention(4, 2, 0.25, None))
    torch.testing.assert_close(auto(0, q, kv, tables, ctx), want, atol=0, rtol=0)
    assert "power-of-two block size" in caplog.text
    with pytest.raises(InvalidRequestError, match="power-of-two block size"):
        TritonPagedAttention(4, 2, 16, 0.25, None)(0, q, kv, tables, ctx)


def test_triton_compile_failure_falls_back_once(monkeypatch, caplog):
    q, kv, tables, ctx = _case([10, 30], 4, 2, 16, 8, torch.float32, seed=2)
    want = GatherAttention(4, 2, 0.25, None)(0, q, kv, tables, ctx)
    auto = TritonPagedAttention(4, 2, 16, 0.25, None, fallback=GatherAttention(4, 2, 0.25, None))
    calls = []

    def broken(*args):
        calls.append(args)
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(auto, "_launch", broken)
    for _ in range(2):
        torch.testing.assert_close(auto(0, q, kv, tables, ctx), want, atol=0, rtol=0)
    assert len(calls) == 1 and "PTX assembly failed" in caplog.text


if __name__ == "__main__":
    print("checked", _triton_cases())
