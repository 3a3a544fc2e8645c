"""Linear layers with weights pre-packed for oneDNN on CPU.

`F.linear` on CPU re-lays out the weight matrix for the GEMM kernel on every
call; at decode batch sizes the step is bound by reading weights, so paying that
reorder each step costs up to half the step (bench/engine.py: lm_head at batch 32
went from ~30 to ~13 ms). Packing once at load time removes it. The packed
kernel is only used for up to `PACKED_MAX_ROWS` input rows (decode steps and
short prefills); long prefills keep the plain path, where the two measured equal
or the plain one faster. On CUDA, or where oneDNN lacks the dtype, it is plain
`F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACKED_MAX_ROWS = 256
_PACK_BATCH_HINT = 32


def _can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Linear:
    """y = x @ weight.T + bias for 2-D x."""

    __slots__ = ("weight", "bias", "_packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.weight = weight
        self.bias = bias
        self._packed = None
        if pack and _can_pack(weight):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)

    @property
    def packed(self) -> bool:
        return self._packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None and x.shape[0] <= PACKED_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
