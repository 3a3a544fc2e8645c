"""A KV transfer's end-to-end digest: the receiver accepts the prompt's KV only if its blocks hold
exactly what the sender wrote.

Why. A one-sided NIXL WRITE lands without the receiver seeing it, and the completion
notification only says the sender posted its writes; a write that went wrong (a bug, a
corrupted or lost transfer) would otherwise decode into wrong tokens behind a status 200. The
sender CRC-32s the source bytes of each (layer, block) it writes — keyed by the layer and the
*destination* block, so bytes that land in the wrong block or never land fail as surely as
flipped ones — and sends the sum in an envelope around the notification's payload (`seal`).
The receiver recomputes the sum over every layer of the blocks it granted (`granted_digest`)
before it hands the payload on; a mismatch is a TransferError, which the decode worker answers
as any failed transfer: the prompt is recomputed, never served from those blocks.

The sender hashes after posting, on its transfer driver's thread, while the prompt's next layers
compute (the source blocks do not change until the send ends); the receiver hashes on a worker
thread. zlib's CRC-32 runs at about 2 GB/s here: 45 ms each side for a 2,000-token prompt of
SmolLM2 in float32 (94 MB). Only CPU pools whose ranks hold the same heads (one rank each side)
are digested; a transfer without the envelope is accepted as before.
"""

from __future__ import annotations

import struct
import zlib

import torch

from splitserve.kvtransfer.layout import KVLayout

MAGIC = b"KVd1"
_HEADER = struct.Struct("<4sQI")          # magic, digest, number of (layer, block) pairs
_MASK = (1 << 64) - 1


def block_crc(pool: torch.Tensor, layout: KVLayout, layer: int, block: int, dst_block: int) -> int:
    """CRC-32 of one layer's K and V bytes of `block`, keyed by (layer, the block it lands in)."""
    crc = (layer * 1_000_003 + dst_block) & 0xFFFFFFFF
    parts = (pool[layer, block],) if layout.paged else (pool[layer, 0, block], pool[layer, 1, block])
    for part in parts:
        crc = zlib.crc32(part.contiguous().view(torch.uint8).numpy(), crc)
    return crc


def add(total: int, crc: int) -> int:
    return (total + crc) & _MASK


def digest(pool: torch.Tensor, layout: KVLayout, layer: int, src_blocks: list[int], dst_blocks: list[int]) -> int:
    """The sum of `block_crc` over one write's blocks."""
    total = 0
    for src, dst in zip(src_blocks, dst_blocks):
        total = add(total, block_crc(pool, layout, layer, src, dst))
    return total


def granted_digest(pool: torch.Tensor, layout: KVLayout, block_ids: list[int]) -> tuple[int, int]:
    """(sum, pairs) over every layer of the granted `block_ids`, as they are in `pool` now."""
    total = 0
    for layer in range(layout.num_layers):
        total = add(total, digest(pool, layout, layer, block_ids, block_ids))
    return total, layout.num_layers * len(block_ids)


def seal(payload: bytes, total: int, pairs: int) -> bytes:
    return _HEADER.pack(MAGIC, total, pairs) + payload


def unseal(payload: bytes) -> tuple[tuple[int, int] | None, bytes]:
    """((sum, pairs), inner payload) of a sealed payload; (None, payload) of one without the envelope."""
    if len(payload) < _HEADER.size or payload[:4] != MAGIC:
        return None, payload
    _, total, pairs = _HEADER.unpack_from(payload)
    return (total, pairs), payload[_HEADER.size:]
