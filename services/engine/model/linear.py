"""Linear layers on CPU: oneDNN's pre-packed GEMM or plain `F.linear`, whichever this CPU runs faster.

`F.linear` on CPU re-lays out the weight matrix for the GEMM kernel on every call;
packing once at load time (oneDNN) removes that, and on an AVX-512 machine it won
everywhere (bench/engine.py: lm_head at batch 32 from ~30 to ~13 ms). On an AVX2-only
EPYC the same packing lost at one row by up to 3× for the small matrices while still
winning for lm_head. So the choice is measured, not assumed: for each weight shape and
dtype, both kernels are timed at 1, 4, 16 and 64 rows on this CPU and thread count
(over copies of the matrix that spill the caches, as a model's weights do; the plain
kernel has to win by 5 %, as closer timings are noise here), and a call takes the winner of the nearest measured row count at or above its own
(64 for up to `PACKED_MAX_ROWS` rows; longer prefills always take the plain path,
where the two measured equal or the plain one faster).

Measurements are kept in `~/.cache/splitserve/kernels/gemm-<key>.json` (the key: the
CPU's model and flags, torch, the thread count) under a file lock, so the workers of
one machine measure once and then agree. `SPLITSERVE_GEMM=packed|plain` skips the
measurement (benchmarks of the kernels themselves). On CUDA, or where oneDNN lacks
the dtype, it is plain `F.linear`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time

import torch
import torch.nn.functional as F

PACKED_MAX_ROWS = 256
MEASURED_ROWS = (1, 4, 16, 64)
_PACK_BATCH_HINT = 32
TIE_MARGIN = 0.05            # plain must beat packed by this much: within it, timings here are noise
COLD_BYTES = 48 << 20        # timed weights per kernel: more than the caches hold (32 MiB L3 here)
_choices: dict[str, tuple[bool, ...]] | None = None    # shape key → packed wins, per MEASURED_ROWS


def _can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _cache_file():
    from splitserve.services.engine.kernels.build import cache_root, cpu_identity

    key = hashlib.sha256(f"{cpu_identity()}\n{torch.__version__}\n{torch.get_num_threads()}".encode())
    return cache_root() / f"gemm-{key.hexdigest()[:20]}.json"


def _best_of(fn, copies: list, x: torch.Tensor, rounds: int = 3) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for w in copies:
            fn(x, w)
        best = min(best, time.perf_counter() - start)
    return best


def _measure(weight: torch.Tensor, bias: torch.Tensor | None, packed) -> tuple[bool, ...]:
    # A model's weights stream from memory at every step; one matrix timed again and again
    # would sit in the cache and favour the wrong kernel (measured: F.linear looked faster at
    # 4 rows with a hot 2 MiB matrix and was 1.5x slower over a whole model). So each kernel is
    # timed over enough copies of the matrix to spill the caches.
    copies = max(1, min(32, COLD_BYTES // max(1, weight.numel() * weight.element_size())))
    plains = [weight.clone() for _ in range(copies)]
    packs = [packed] + [torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT) for w in plains[1:]]
    plain = lambda t, w: F.linear(t, w, bias)  # noqa: E731
    fast = lambda t, w: torch.ops.mkldnn._linear_pointwise(t, w, bias, "none", [], "")  # noqa: E731
    wins = []
    for rows in MEASURED_ROWS:
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
        plain(x, plains[0]), fast(x, packs[0])              # first calls allocate
        wins.append(_best_of(fast, packs, x) < (1 + TIE_MARGIN) * _best_of(plain, plains, x))
    return tuple(wins)


def _choice(weight: torch.Tensor, bias: torch.Tensor | None, packed) -> tuple[bool, ...]:
    """Per MEASURED_ROWS, whether the packed kernel wins for this shape: env, cache or measured."""
    global _choices
    forced = os.environ.get("SPLITSERVE_GEMM", "")
    if forced in ("packed", "plain"):
        return (forced == "packed",) * len(MEASURED_ROWS)
    key = f"{weight.shape[0]}x{weight.shape[1]}:{weight.dtype}:{bias is not None}"
    if _choices is not None and key in _choices:
        return _choices[key]
    path = _cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)       # one process measures; the others read its result
        try:
            _choices = {k: tuple(v) for k, v in json.loads(path.read_text()).items()}
        except (OSError, ValueError):
            _choices = {}
        if key not in _choices:
            _choices[key] = _measure(weight, bias, packed)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(_choices))
            os.replace(tmp, path)
    return _choices[key]


class Linear:
    """y = x @ weight.T + bias for 2-D x."""

    __slots__ = ("weight", "bias", "_packed", "_packed_wins")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.weight = weight
        self.bias = bias
        self._packed = None
        self._packed_wins: tuple[bool, ...] = (False,) * len(MEASURED_ROWS)
        if pack and _can_pack(weight):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
            self._packed_wins = _choice(weight, bias, self._packed)
            if not any(self._packed_wins):
                self._packed = None           # plain wins at every size: do not keep a second copy

    @property
    def packed(self) -> bool:
        return self._packed is not None

    def uses_packed(self, rows: int) -> bool:
        if self._packed is None or rows > PACKED_MAX_ROWS:
            return False
        bucket = next((i for i, r in enumerate(MEASURED_ROWS) if rows <= r), len(MEASURED_ROWS) - 1)
        return self._packed_wins[bucket]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_packed(x.shape[0]):
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
