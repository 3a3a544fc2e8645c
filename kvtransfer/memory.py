"""Host memory for KV pools that other processes read or write: transparent huge pages.

Why. On loopback UCX moves DRAM with `cma` (process_vm_writev): the sender's
kernel pins the receiver's pages and copies page by page, so on 4 KiB pages the
page-table work rivals the copy itself (in a VM, every walk is a nested one).
Measured here, two processes on this 2-core VM: a 16 MiB WRITE went from about
5 GiB/s to 11-14 GiB/s, about memcpy speed, once both pools sat on 2 MiB pages.
A NIC registering the pool (RDMA) likewise pins fewer, larger pages.

`advise_huge_pages` asks for transparent huge pages (MADV_HUGEPAGE) over the
2 MiB-aligned interior of a CPU tensor; pages already touched stay as they are
until khugepaged collapses them, so allocate with `empty_pool` (advice first,
then first touch) or register a pool before writing it. `Connector.register`
calls it for CPU pools. Nothing here changes a tensor's contents or address.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)

_libc = None


def _madvise(address: int, length: int, advice: int) -> bool:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice) == 0


def advise_huge_pages(tensor: torch.Tensor) -> int:
    """MADV_HUGEPAGE over the tensor's 2 MiB-aligned interior; bytes advised (0: CPU-only, Linux-only)."""
    if tensor.device.type != "cpu" or not sys.platform.startswith("linux"):
        return 0
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    aligned_start = (start + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    aligned_end = end // HUGE_PAGE * HUGE_PAGE
    if aligned_end <= aligned_start:
        return 0
    if not _madvise(aligned_start, aligned_end - aligned_start, _MADV_HUGEPAGE):
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
        return 0
    return aligned_end - aligned_start


def empty_pool(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """torch.empty(shape) that, on the CPU, asks for huge pages before the memory is first touched."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(tensor)
    return tensor
