"""Which bytes go where: contiguous-run coalescing and tensor-parallel head slicing.

Inside one layer's region (layout.py) a block's bytes sit differently in the two layouts:
layer-major keeps a K region `[blocks][block_size][local_kv_heads][head_dim]` and a V
region after it, so a block is two spans; paged keeps one page per block,
`[local_kv_heads][2][block_size][head_dim]`, so a block is one span. When both sides hold
the same head range, consecutive block ids merge into one span per K/V (layer-major) or
one span (paged): on *both* sides for a one-sided write (`run_arrays` and `block_rows`:
NIXL, one descriptor per run), on each side separately where each side walks its own
bytes (`side_runs`, `run_spans`: TCP's sendmsg and recvmsg_into). A request whose blocks
are contiguous moves as one or two spans; `run_length_histogram` says how long the runs of
a workload are. Coalescing never applies to sliced heads (below): there a block's bytes
are not one span.

When the head ranges differ (prefill TP=2 → decode TP=1, or the reverse), only
the intersection `[lo, hi)` of the two ranges moves. Layer-major strides those heads
within a block: each token row holds `hi - lo` heads at a different offset on each side.
A paged block keeps them together: one span of `hi - lo` heads' K and V. Two strategies,
chosen per backend:

- TCP mediates every write, so the sender gathers the slice into one contiguous
  buffer (`gather_slice`) and the receiver scatters it with one strided torch copy
  (`scatter_slice`): two memcpy-speed passes, no per-row Python work. Both work on the
  pool's bytes, so any dtype (FP8 too) moves the same way.
- NIXL is one-sided, so the bytes must land in place (`slice_descriptors`, built with
  numpy, no Python loop over rows). Layer-major needs one descriptor per token row
  (`row_descriptors`); rows are `(hi - lo) * head_dim * itemsize` bytes, so those
  transfers are descriptor-bound rather than bandwidth-bound, the price of writing a TP=1
  pool from two ranks without a receiver-side copy. Paged needs one per block
  (`page_descriptors`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from splitserve.kvtransfer.layout import KVLayout


def joint_runs(src_block_ids: list[int], dst_block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, count) runs where both sides are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_block_ids, dst_block_ids):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def run_arrays(src_block_ids, dst_block_ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`joint_runs` vectorised: (src_starts, dst_starts, counts) as int64 arrays, no Python loop per block."""
    src = np.asarray(src_block_ids, dtype=np.int64)
    dst = np.asarray(dst_block_ids, dtype=np.int64)
    if src.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [src.size])))
    return src[starts], dst[starts], counts


def block_run_arrays(block_ids) -> tuple[np.ndarray, np.ndarray]:
    """`block_runs` vectorised: (starts, counts) as int64 arrays."""
    starts, _, counts = run_arrays(block_ids, block_ids)
    return starts, counts


def side_runs(block_ids, coalesce: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(starts, counts) of `block_ids`: runs of consecutive ids, or one per block without `coalesce`."""
    if coalesce:
        return block_run_arrays(block_ids)
    ids = np.asarray(block_ids, dtype=np.int64)
    return ids, np.ones_like(ids)


def layer_spans(starts: np.ndarray, counts: np.ndarray, k_offset: int, num_blocks: int,
                block_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Byte (offsets, lengths) of runs of blocks in one layer-major layer: every K run, then every V run.

    `k_offset` is where the layer's K region starts; its V region follows `num_blocks` blocks later.
    """
    k = k_offset + starts * block_bytes
    return np.concatenate((k, k + num_blocks * block_bytes)), np.tile(counts * block_bytes, 2)


def page_spans(starts: np.ndarray, counts: np.ndarray, layer_offset: int,
               page_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Byte (offsets, lengths) of runs of blocks in one paged layer: one span per run, K and V inside."""
    return layer_offset + starts * page_bytes, counts * page_bytes


def run_spans(layout: KVLayout, starts: np.ndarray, counts: np.ndarray, layer_offset: int,
              num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Byte spans of runs of blocks in the layer at `layer_offset` of a `layout` pool of `num_blocks`."""
    if layout.paged:
        return page_spans(starts, counts, layer_offset, layout.page_bytes)
    return layer_spans(starts, counts, layer_offset, num_blocks, layout.block_bytes)


def block_rows(layout: KVLayout, block_ids, num_blocks: int) -> np.ndarray:
    """Rows holding `block_ids` in a layer's table of `2 * num_blocks` rows of `block_bytes`.

    Layer-major: every K row, then every V row (b, then num_blocks + b). Paged: each page's
    two halves in turn (2b, 2b + 1), so consecutive blocks give consecutive rows.
    """
    ids = np.asarray(block_ids, dtype=np.int64)
    if layout.paged:
        return np.stack((2 * ids, 2 * ids + 1), axis=1).reshape(-1)
    return np.concatenate((ids, ids + num_blocks))


def run_length_histogram(counts) -> dict[int, int]:
    """Run length → how many runs have it, ascending by length."""
    lengths, times = np.unique(np.asarray(counts, dtype=np.int64), return_counts=True)
    return dict(zip(lengths.tolist(), times.tolist()))


def block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """(start, count) runs of consecutive ids, in the given order."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and b == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """The heads `[lo, hi)` that move between a sender rank and a receiver rank."""

    lo: int
    hi: int
    src_offset: int          # first moved head's index within the sender's local heads
    dst_offset: int          # ... within the receiver's local heads
    whole_rows: bool         # both sides hold exactly [lo, hi): blocks move whole

    @property
    def num_heads(self) -> int:
        return self.hi - self.lo


def head_slice(src: KVLayout, dst: KVLayout) -> HeadSlice | None:
    """The heads a `src` rank writes into a `dst` rank; None when the ranges do not overlap."""
    lo, hi = max(src.head_start, dst.head_start), min(src.head_end, dst.head_end)
    if lo >= hi:
        return None
    whole = (src.head_start, src.head_end) == (dst.head_start, dst.head_end)
    return HeadSlice(lo, hi, lo - src.head_start, lo - dst.head_start, whole)


def gather_slice(pool: torch.Tensor, layer: int, block_ids, hs: HeadSlice, paged: bool = False) -> torch.Tensor:
    """Contiguous bytes of the moved heads of `block_ids`, shaped like a layer of those blocks
    (`KVLayout.layer_shape`, the last dim in bytes): what a rank holding exactly those heads keeps."""
    index = _index(block_ids, pool.device)
    heads = slice(hs.src_offset, hs.src_offset + hs.num_heads)
    region = pool[layer].view(torch.uint8)
    if paged:
        return region.index_select(0, index)[:, heads].contiguous()
    return region.index_select(1, index)[:, :, :, heads].contiguous()


def scatter_slice(pool: torch.Tensor, layer: int, block_ids, hs: HeadSlice, data: torch.Tensor,
                  paged: bool = False) -> None:
    """Inverse of gather_slice on the receiving pool (`data` in any dtype of the same bytes)."""
    index = _index(block_ids, pool.device)
    heads = slice(hs.dst_offset, hs.dst_offset + hs.num_heads)
    # Bytes, not values: torch has no CPU index_copy for FP8, and a byte copy is exact for every dtype.
    region, data = pool[layer].view(torch.uint8), data.view(torch.uint8).to(pool.device)
    if paged:
        region[:, heads].index_copy_(0, index, data)
        return
    for kv in range(2):
        region[kv][:, :, heads].index_copy_(0, index, data[kv])


def _index(block_ids, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(block_ids, dtype=np.int64)).to(device)


def slice_descriptors(base: int, num_blocks: int, block_ids, layout: KVLayout, head_offset: int,
                      num_heads: int) -> np.ndarray:
    """(addr, len) rows for the moved heads of `block_ids` in the layer at `base`, int64 [rows, 2].

    `layout` and `num_blocks` are this side's; both sides list their rows in the same order.
    """
    if layout.paged:
        return page_descriptors(base, block_ids, layout, head_offset, num_heads)
    return row_descriptors(base, base + num_blocks * layout.block_bytes, block_ids, layout, head_offset,
                           num_heads)


def row_descriptors(base_k: int, base_v: int, block_ids: list[int], layout: KVLayout,
                    head_offset: int, num_heads: int) -> np.ndarray:
    """(addr, len) rows for the moved heads of each token row, K blocks then V blocks (layer-major).

    `base_k`/`base_v` are this side's layer K/V region addresses; `layout` gives this
    side's row geometry. Returns an int64 array [2 * n * block_size, 2].
    """
    blocks = np.asarray(block_ids, dtype=np.int64)
    rows = np.arange(layout.block_size, dtype=np.int64)
    offsets = (blocks[:, None] * layout.block_bytes + rows[None, :] * layout.row_bytes
               + head_offset * layout.head_dim * layout.itemsize).reshape(-1)
    addrs = np.concatenate([base_k + offsets, base_v + offsets])
    length = num_heads * layout.head_dim * layout.itemsize
    return np.stack([addrs, np.full_like(addrs, length)], axis=1)


def page_descriptors(base: int, block_ids, layout: KVLayout, head_offset: int, num_heads: int) -> np.ndarray:
    """(addr, len) per block for the moved heads of a paged layer at `base`: int64 [n, 2].

    A page is head-major, so a head range's K and V are one span.
    """
    blocks = np.asarray(block_ids, dtype=np.int64)
    head_bytes = 2 * layout.block_size * layout.head_dim * layout.itemsize
    addrs = base + blocks * layout.page_bytes + head_offset * head_bytes
    return np.stack([addrs, np.full_like(addrs, num_heads * head_bytes)], axis=1)
