"""The KV layout both sides of a transfer must agree on, and the handshake check.

Two pool layouts, named by the `layout` field:

- `LAYOUT_NAME` ("layer-major-v1"), the built-in engine's pool
  (services/engine/kv_cache.py): `[layers][2][blocks][block_size][local_kv_heads][head_dim]`,
  so one layer's K blocks form one contiguous region and its V blocks another.
- `PAGED_LAYOUT` ("paged-heads-kv-v1"), vLLM's CPU attention buffer:
  `[layers][blocks][local_kv_heads][2][block_size][head_dim]`, one contiguous page per
  (layer, block) holding K then V of each local head, head-major.

In both, layer l is one region of `layer_bytes(num_blocks)` bytes at the pool's base plus
l times that, and a block's K and V take `page_bytes` of it; only where those bytes sit
inside the layer differs (tp_slicing.py turns that into spans and descriptors).

Two peers can exchange blocks only if everything that shapes a block's bytes matches:
model identity, dtype, layer count, total KV heads, head dim, block size, layout name,
connector version and the workers' compatibility fingerprint (the weights' and tokenizer's
digests and the engine: splitserve/checkpoints/fingerprint.py; a rolling update that changes the
weights under one model name changes it). Those fields go into `layout_hash()`; a peer whose hash differs is
refused, and `compare()` names the fields so the refusal says what to fix (a built-in peer
and a paged one differ in `layout`). The dtype only sizes the bytes, so FP8 KV moves like
any other.

Tensor-parallel degree is deliberately *not* hashed: a TP rank holds the KV
heads `[head_start, head_end)` of the model, and a transfer between ranks that
hold different head ranges writes the intersection of the two ranges into the
right offsets (see `tp_slicing.py`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields

import torch

from splitserve.checkpoints.fingerprint import differences

LAYOUT_NAME = "layer-major-v1"
PAGED_LAYOUT = "paged-heads-kv-v1"      # vLLM's LBHNC page: per (layer, block) [local heads][K,V][block_size][head_dim]
LAYOUTS = (LAYOUT_NAME, PAGED_LAYOUT)
CONNECTOR_VERSION = 1

# Fields that must be equal on both sides; order is part of the hash.
HASHED_FIELDS = ("model", "dtype", "num_layers", "num_kv_heads", "head_dim", "block_size",
                 "layout", "connector_version", "fingerprint")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` → "bfloat16" (the form stored in a layout)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """One side's KV geometry. `num_kv_heads` is the model's total; this rank holds a slice."""

    model: str                    # model identity (name, revision, LoRA...): anything that changes KV
    dtype: str                    # "float32" | "bfloat16" | "float16" | "float8_e4m3fn" | "float8_e5m2"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    layout: str = LAYOUT_NAME     # LAYOUT_NAME | PAGED_LAYOUT
    connector_version: int = CONNECTOR_VERSION
    tp_rank: int = 0
    tp_size: int = 1
    fingerprint: str = ""         # Fingerprint.text() of the worker (fingerprint.py); "": none given

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; expected one of {sorted(_DTYPES)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown KV layout {self.layout!r}; expected one of {list(LAYOUTS)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")
        if self.num_kv_heads % self.tp_size:
            raise ValueError(f"{self.num_kv_heads} KV heads do not split evenly over TP={self.tp_size}")

    # -- geometry of this rank ------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def num_local_kv_heads(self) -> int:
        return self.num_kv_heads // self.tp_size

    @property
    def head_start(self) -> int:
        return self.tp_rank * self.num_local_kv_heads

    @property
    def head_end(self) -> int:
        return self.head_start + self.num_local_kv_heads

    @property
    def row_bytes(self) -> int:
        """Bytes of one token row of one block (all local heads) for K or for V (paged: a size only,
        since a page keeps each head's rows together)."""
        return self.num_local_kv_heads * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer, K or V (not both)."""
        return self.block_size * self.row_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer, K and V: a paged layout's page."""
        return 2 * self.block_bytes

    @property
    def paged(self) -> bool:
        return self.layout == PAGED_LAYOUT

    def layer_bytes(self, num_blocks: int) -> int:
        """Bytes of one layer's region in a pool of `num_blocks` blocks (either layout)."""
        return num_blocks * self.page_bytes

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, *self.layer_shape(num_blocks))

    def layer_shape(self, num_blocks: int, num_heads: int | None = None) -> tuple[int, ...]:
        """One layer of `num_blocks` blocks holding `num_heads` heads (default: this rank's).

        A staged head slice has this shape too, so its bytes are what a rank holding exactly
        those heads keeps for those blocks (tp_slicing.gather_slice).
        """
        heads = self.num_local_kv_heads if num_heads is None else num_heads
        if self.paged:
            return (num_blocks, heads, 2, self.block_size, self.head_dim)
        return (2, num_blocks, self.block_size, heads, self.head_dim)

    def num_blocks_in(self, shape: tuple[int, ...]) -> int:
        """The blocks of a pool of `shape` (the dimension `pool_shape` puts them in); -1 if not 6-D."""
        if len(shape) != 6:
            return -1
        return shape[1] if self.paged else shape[2]

    def with_tp(self, tp_rank: int, tp_size: int) -> KVLayout:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(tp_rank=tp_rank, tp_size=tp_size)
        return KVLayout(**values)

    # -- handshake ------------------------------------------------------------------------
    def layout_hash(self) -> str:
        """SHA-256 hex over the fields that must match between peers (not TP)."""
        h = hashlib.sha256()
        for name in HASHED_FIELDS:
            if name == "fingerprint" and not self.fingerprint:
                continue                 # a layout without one hashes as before fingerprints existed
            h.update(name.encode())
            h.update(b"=")
            h.update(str(getattr(self, name)).encode())
            h.update(b"\x00")
        return h.hexdigest()

    def compare(self, other: KVLayout) -> list[str]:
        """Names of the hashed fields whose values differ; empty when compatible."""
        return [name for name in HASHED_FIELDS if getattr(self, name) != getattr(other, name)]

    def describe_mismatch(self, other: KVLayout) -> str:
        return ", ".join(f"fingerprint: {differences(self.fingerprint, other.fingerprint)}" if name == "fingerprint"
                         else f"{name}: local {getattr(self, name)!r} vs peer {getattr(other, name)!r}"
                         for name in self.compare(other))
