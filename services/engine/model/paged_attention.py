"""Decode attention over the paged KV pool: in place (a kernel per device) or through a padded copy.

Each decode row is one query token that attends to its own cached context. Two
implementations, chosen once per engine (`EngineConfig.attention_backend`):

- `paged`: read every sequence's keys and values where they lie in the pool, through
  its block table. A step's cost is the tokens actually cached, not batch × the longest
  context. On CPU `kernels/paged_attention.cpp` (built for this CPU at first use); on
  CUDA a Triton kernel (`triton_paged_attention.py`).
- `gather`: the previous path (kept as the baseline and the fallback): copy each
  sequence's blocks into a padded [batch, kv_heads, longest, head_dim] tensor per
  layer, mask the padding and call PyTorch's SDPA.

`auto` is `paged` where its kernel builds, else `gather` (with the reason logged).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Protocol

import torch
import torch.nn.functional as F

from splitserve.errors import InvalidRequestError
from splitserve.services.engine.kernels.build import KernelUnavailable, load
from splitserve.services.engine.kv_cache import KVCache

log = logging.getLogger(__name__)

BACKENDS = ("auto", "paged", "gather")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class DecodeAttention(Protocol):
    name: str

    def __call__(self, layer: int, q: torch.Tensor, kv: KVCache, block_tables: torch.Tensor,
                 context_lens: torch.Tensor) -> torch.Tensor:
        """q: [D, heads, d]; block_tables [D, M] long (padded with 0); context_lens [D] long
        (each >= 1). Returns [D, heads, d]."""


class GatherAttention:
    """Copy each row's blocks out of the pool, mask the padding, run SDPA."""

    name = "gather"

    def __init__(self, num_heads: int, num_kv_heads: int, scale: float, sliding_window: int | None):
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.scale, self.window = scale, sliding_window

    def mask(self, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> torch.Tensor:
        """[D, 1, 1, L] bool: which gathered key slots each decode row may attend to."""
        key_pos = torch.arange(block_tables.shape[1] * block_size, device=context_lens.device)
        ctx = context_lens.unsqueeze(1)
        mask = key_pos < ctx
        if self.window:
            mask &= key_pos > ctx - 1 - self.window
        return mask[:, None, None, :]

    def __call__(self, layer, q, kv, block_tables, context_lens, mask=None):
        d, head_dim = q.shape[0], q.shape[-1]
        if mask is None:
            mask = self.mask(block_tables, context_lens, kv.block_size)
        keys, values = kv.gather(layer, block_tables)          # [D, kv_heads, L, d]
        # Grouped-query: the query heads sharing a KV head become that head's "query rows".
        qg = q.view(d, self.num_kv_heads, self.num_heads // self.num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=self.scale)
        return out.reshape(d, self.num_heads, head_dim)


class PagedAttention:
    """The in-place CPU kernel (kernels/paged_attention.cpp)."""

    name = "paged"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None):
        if num_heads % num_kv_heads:
            raise KernelUnavailable(f"{num_heads} query heads over {num_kv_heads} KV heads")
        if head_dim % 8:
            raise KernelUnavailable(f"head_dim {head_dim} is not a multiple of 8")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.scale, self.window = scale, sliding_window or 0
        self._fn = load("paged_attention").splitserve_paged_decode_attention
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 6, *[ctypes.c_int64] * 7, ctypes.c_float]

    def __call__(self, layer, q, kv, block_tables, context_lens, mask=None):
        pool = kv.layer(layer)                                  # [2, blocks, block_size, kv_heads, d]
        if q.device.type != "cpu" or pool.dtype not in _DTYPE_CODES or q.dtype != pool.dtype:
            raise InvalidRequestError(f"paged attention needs CPU tensors of one dtype, got {q.dtype} "
                                      f"on {q.device} and a {pool.dtype} pool")
        q = q.contiguous()
        tables = block_tables.contiguous()
        lens = context_lens.contiguous()
        out = torch.empty_like(q)
        num_seqs, num_heads, head_dim = q.shape
        rc = self._fn(_DTYPE_CODES[q.dtype], q.data_ptr(), pool[0].data_ptr(), pool[1].data_ptr(),
                      tables.data_ptr(), lens.data_ptr(), out.data_ptr(), num_seqs, num_heads,
                      self.num_kv_heads, head_dim, kv.block_size, tables.shape[1], self.window, self.scale)
        if rc != 0:
            raise RuntimeError(f"paged attention kernel returned {rc}")
        return out


def make_decode_attention(backend: str, device: torch.device, num_heads: int, num_kv_heads: int,
                          head_dim: int, scale: float, sliding_window: int | None) -> DecodeAttention:
    if backend not in BACKENDS:
        raise InvalidRequestError(f"attention backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    args = (num_heads, num_kv_heads, scale, sliding_window)
    if backend == "gather":
        return GatherAttention(*args)
    try:
        if device.type == "cpu":
            return PagedAttention(num_heads, num_kv_heads, head_dim, scale, sliding_window)
        if device.type != "cuda":
            raise KernelUnavailable(f"no in-place kernel for {device.type}")
        from splitserve.services.engine.model.triton_paged_attention import TritonPagedAttention

        return TritonPagedAttention(num_heads, num_kv_heads, head_dim, scale, sliding_window,
                                    fallback=GatherAttention(*args) if backend == "auto" else None)
    except KernelUnavailable as exc:
        if backend == "paged":
            raise InvalidRequestError(f"attention backend 'paged' is unavailable here: {exc}") from None
        log.warning("paged decode attention unavailable (%s); decoding through the gather path", exc)
        return GatherAttention(*args)
