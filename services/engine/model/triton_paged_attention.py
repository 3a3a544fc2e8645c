"""Decode attention in place on CUDA: a Triton kernel that walks each sequence's block table.

The CUDA counterpart of `kernels/paged_attention.cpp`. One program per (sequence, KV head)
loads the query heads that share that KV head, then reads the sequence's blocks where they
lie in the pool ([blocks, block_size, kv_heads, head_dim] for K and for V) with an online
softmax, so a step costs the tokens cached, not batch × the longest context as the gather
path's padded copy does. Sliding windows start at the window's first block.

Triton, not FlashInfer or FlashAttention: the GPU machines this project is checked on have
torch and Triton but no network, and neither of those installs from PyPI as a wheel that
fits the 64 MiB that travels with the tree (FlashInfer compiles its kernels with nvcc at
first use). Triton ships with PyPI's torch on Linux.

On CPU the kernel runs only under Triton's interpreter (`TRITON_INTERPRET=1`), which is how
the unit tests check it against the gather path on machines without a GPU; the kernel is
compiled on first use so that the interpreter setting read then is the one that applies.
"""

from __future__ import annotations

import logging
import os

import torch

from splitserve.errors import InvalidRequestError
from splitserve.services.engine.kernels.build import KernelUnavailable
from splitserve.services.engine.kv_cache import KVCache

log = logging.getLogger(__name__)
_kernels: dict[bool, object] = {}


def _kernel():
    """The jitted kernel for the current TRITON_INTERPRET setting (compiled on first use)."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if interpret not in _kernels:
        try:
            import triton

            from splitserve.services.engine.kernels.paged_attention_triton import paged_decode
        except ImportError as exc:
            raise KernelUnavailable(f"triton is not installed ({exc})") from None
        _kernels[interpret] = triton.jit(paged_decode)
    return _kernels[interpret]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class TritonPagedAttention:
    """The in-place CUDA kernel; same contract as `paged_attention.PagedAttention`."""

    name = "paged"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None, fallback=None):
        if num_heads % num_kv_heads:
            raise KernelUnavailable(f"{num_heads} query heads over {num_kv_heads} KV heads")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale, self.window = scale, sliding_window or 0
        self._kernel = _kernel()
        self._fallback = fallback        # `auto`: the gather path, if the kernel fails to compile here

    def __call__(self, layer: int, q: torch.Tensor, kv: KVCache, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, mask=None) -> torch.Tensor:
        pool = kv.layer(layer)                                  # [2, blocks, block_size, kv_heads, d]
        if q.dtype != pool.dtype or q.device != pool.device:
            raise InvalidRequestError(f"paged attention needs one dtype and device, got {q.dtype} on "
                                      f"{q.device} and a {pool.dtype} pool on {pool.device}")
        if self._kernel is not None:
            if kv.block_size & (kv.block_size - 1):
                reason = f"the Triton paged kernel needs a power-of-two block size, not {kv.block_size}"
            else:
                try:
                    return self._launch(pool, q, block_tables, context_lens)
                except Exception as exc:   # Triton compiles at the first call: compiler errors land here
                    if self._fallback is None:
                        raise
                    reason = f"the Triton paged kernel failed: {exc}"
            if self._fallback is None:
                raise InvalidRequestError(reason)
            log.warning("%s; decoding through the gather path from now on", reason)
            self._kernel = None
        return self._fallback(layer, q, kv, block_tables, context_lens)

    def _launch(self, pool: torch.Tensor, q: torch.Tensor, block_tables: torch.Tensor,
                context_lens: torch.Tensor) -> torch.Tensor:
        block_size = pool.shape[2]
        q = q.contiguous()
        tables = block_tables.contiguous()
        lens = context_lens.contiguous()
        keys, values = pool[0], pool[1]
        out = torch.empty_like(q)
        self._kernel[(q.shape[0], self.num_kv_heads)](
            q, keys, values, tables, lens, out,
            q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
            tables.stride(0), out.stride(0), out.stride(1), self.scale, self.window,
            GROUP=self.group, GROUP_PAD=_pow2(self.group), HEAD_DIM=self.head_dim,
            DIM_PAD=_pow2(self.head_dim), BLOCK_SIZE=block_size)
        return out
