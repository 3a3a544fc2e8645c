"""The two pool layouts' geometry: shapes, the byte spans and table rows of block runs, and head
slices, checked against the bytes of real pools (a span list is right when copying its bytes
gives what the layout's own indexing gives)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitserve.kvtransfer.layout import LAYOUT_NAME, PAGED_LAYOUT, KVLayout
from splitserve.kvtransfer.tp_slicing import (block_rows, gather_slice, head_slice, run_spans, scatter_slice,
                                              side_runs, slice_descriptors)

NUM_BLOCKS = 6
BLOCK_IDS = [4, 5, 0, 2, 3]                     # runs (4, 2), (0, 1), (2, 2)


def layout(name: str, dtype: str = "bfloat16", **changes) -> KVLayout:
    values = dict(model="m", dtype=dtype, num_layers=2, num_kv_heads=4, head_dim=8, block_size=4, layout=name)
    values.update(changes)
    return KVLayout(**values)


def random_pool(lay: KVLayout, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(lay.pool_shape(NUM_BLOCKS), generator=generator).to(lay.torch_dtype)


def as_bytes(pool: torch.Tensor) -> np.ndarray:
    return pool.view(torch.uint8).reshape(-1).numpy()


def blocks_of(lay: KVLayout, pool: torch.Tensor, layer: int, block_ids) -> bytes:
    """The layer's bytes of `block_ids` in wire order, by the layout's own indexing."""
    region = pool[layer]
    picked = region[block_ids] if lay.paged else region[:, block_ids]
    return picked.contiguous().view(torch.uint8).numpy().tobytes()


def test_paged_pool_shape_and_blocks():
    paged = layout(PAGED_LAYOUT).with_tp(1, 2)
    assert paged.pool_shape(10) == (2, 10, 2, 2, 4, 8)
    assert paged.layer_shape(3, num_heads=1) == (3, 1, 2, 4, 8)
    assert paged.num_blocks_in((2, 10, 2, 2, 4, 8)) == 10
    builtin = layout(LAYOUT_NAME).with_tp(1, 2)
    assert builtin.pool_shape(10) == (2, 2, 10, 4, 2, 8)
    assert builtin.num_blocks_in(builtin.pool_shape(10)) == 10
    assert paged.num_blocks_in((10, 8)) == builtin.num_blocks_in((10, 8)) == -1
    assert paged.page_bytes == builtin.page_bytes == 2 * 4 * 2 * 8 * 2
    assert paged.layer_bytes(10) == 10 * paged.page_bytes


def test_unknown_layout_is_refused_and_the_layout_field_is_hashed():
    with pytest.raises(ValueError, match="paged-heads-kv-v1"):
        layout("layer-major-v2")
    paged, builtin = layout(PAGED_LAYOUT), layout(LAYOUT_NAME)
    assert paged.layout_hash() != builtin.layout_hash()
    assert paged.compare(builtin) == ["layout"]
    assert "layout: local 'paged-heads-kv-v1' vs peer 'layer-major-v1'" in paged.describe_mismatch(builtin)


def test_fp8_dtypes_are_one_byte():
    for dtype, torch_dtype in (("float8_e4m3fn", torch.float8_e4m3fn), ("float8_e5m2", torch.float8_e5m2)):
        lay = layout(PAGED_LAYOUT, dtype)
        assert (lay.torch_dtype, lay.itemsize, lay.page_bytes) == (torch_dtype, 1, 2 * 4 * 4 * 8)


@pytest.mark.parametrize("name", [LAYOUT_NAME, PAGED_LAYOUT])
@pytest.mark.parametrize("coalesce", [True, False])
def test_run_spans_cover_the_blocks_in_wire_order(name, coalesce):
    lay = layout(name)
    pool = random_pool(lay)
    flat = as_bytes(pool)
    starts, counts = side_runs(BLOCK_IDS, coalesce)
    offsets, lengths = run_spans(lay, starts, counts, lay.layer_bytes(NUM_BLOCKS), NUM_BLOCKS)
    got = b"".join(flat[o:o + n].tobytes() for o, n in zip(offsets.tolist(), lengths.tolist()))
    assert got == blocks_of(lay, pool, 1, BLOCK_IDS)
    assert len(offsets) == (1 if lay.paged else 2) * (3 if coalesce else len(BLOCK_IDS))


def test_paged_spans_are_one_per_run():
    lay = layout(PAGED_LAYOUT)
    offsets, lengths = run_spans(lay, np.array([4, 0]), np.array([2, 1]), 1000, NUM_BLOCKS)
    assert offsets.tolist() == [1000 + 4 * lay.page_bytes, 1000]
    assert lengths.tolist() == [2 * lay.page_bytes, lay.page_bytes]


@pytest.mark.parametrize("name", [LAYOUT_NAME, PAGED_LAYOUT])
def test_block_rows_pick_the_blocks_from_the_layer_table(name):
    """NIXL's table: 2 * num_blocks rows of block_bytes from the layer's base."""
    lay = layout(name)
    pool = random_pool(lay)
    rows = as_bytes(pool[1]).reshape(2 * NUM_BLOCKS, lay.block_bytes)
    picked = block_rows(lay, BLOCK_IDS, NUM_BLOCKS)
    assert rows[picked].tobytes() == blocks_of(lay, pool, 1, BLOCK_IDS)


def test_paged_block_rows_of_consecutive_blocks_are_consecutive():
    lay = layout(PAGED_LAYOUT)
    assert block_rows(lay, [2, 3, 5], NUM_BLOCKS).tolist() == [4, 5, 6, 7, 10, 11]
    assert block_rows(layout(LAYOUT_NAME), [2, 3, 5], NUM_BLOCKS).tolist() == [2, 3, 5, 8, 9, 11]


@pytest.mark.parametrize("name", [LAYOUT_NAME, PAGED_LAYOUT])
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_head_slices_gather_scatter_and_descriptors_agree(name, dtype):
    """TP=1 → the rank holding heads [2, 4): gather/scatter (TCP) and descriptors (NIXL) write the same bytes."""
    full = layout(name, dtype)
    rank1 = full.with_tp(1, 2)
    src, hs = random_pool(full), head_slice(full, rank1)
    src_ids, dst_ids = [1, 2, 5], [5, 0, 3]
    staged = gather_slice(src, 1, src_ids, hs, full.paged)
    assert staged.shape[:-1] == rank1.layer_shape(3)[:-1]
    dst = torch.zeros(rank1.pool_shape(NUM_BLOCKS), dtype=full.torch_dtype)
    scatter_slice(dst, 1, dst_ids, hs, staged, rank1.paged)
    want = src[1][src_ids][:, 2:] if full.paged else src[1][:, src_ids][:, :, :, 2:]
    got = dst[1][dst_ids] if full.paged else dst[1][:, dst_ids]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))

    # One-sided path: copy what the descriptors name, byte by byte, and compare.
    dst2 = torch.zeros_like(dst)
    src_bytes, dst_bytes = as_bytes(src), as_bytes(dst2)
    base_src, base_dst = full.layer_bytes(NUM_BLOCKS), rank1.layer_bytes(NUM_BLOCKS)
    s_rows = slice_descriptors(base_src, NUM_BLOCKS, src_ids, full, hs.src_offset, hs.num_heads)
    d_rows = slice_descriptors(base_dst, NUM_BLOCKS, dst_ids, rank1, hs.dst_offset, hs.num_heads)
    per_block = 1 if full.paged else 2 * full.block_size
    assert s_rows.shape == d_rows.shape == (per_block * len(src_ids), 2)
    for (sa, n), (da, m) in zip(s_rows.tolist(), d_rows.tolist()):
        assert n == m
        dst_bytes[da:da + m] = src_bytes[sa:sa + n]
    assert torch.equal(dst2.view(torch.uint8), dst.view(torch.uint8))
