"""A KV transfer's end-to-end digest: the receiver accepts the prompt's KV only if its blocks hold
exactly what the sender wrote.

Why. A one-sided NIXL WRITE lands without the receiver seeing it, and the completion
notification only says the sender posted its writes; a write that went wrong (a bug, a
corrupted or lost transfer) would otherwise decode into wrong tokens behind a status 200. The
sender hashes the source bytes it writes and sends the digest in an envelope around the
notification's payload (`seal`); the receiver hashes what its granted blocks hold
(`held_digest`) before it hands the payload on. A mismatch is a TransferError, which the decode
worker answers as any failed transfer: the prompt is recomputed, never served from those blocks.

The digest (`StreamDigest`, envelope `KVd3`): per layer, and per K/V half where the layout keeps
them apart, one xxh3-64 stream (seeded with the layer and half) over the blocks' bytes in the
grant's order — the order of the *destination* blocks, so bytes that land in the wrong block or
never land fail as surely as flipped ones. The sender feeds each write's source blocks as it posts
them (a layer arrives in chunks, in block order), the receiver each run of consecutive granted
blocks; a run is one contiguous span per half, so hashing costs one call per run and half instead
of one per block (xxh3 at ~15 GB/s on the 2-core EPYC: ~6 ms each side for a 2,000-token prompt
of SmolLM2 in float32, 94 MB). Envelopes of earlier senders are still checked during a rolling
update: `KVd2` (the sum of a per-(layer, destination block) xxh3-64) and `KVd1` (the same with
zlib CRC-32), `BlockSumDigest` here.

The sender hashes after posting, on its transfer driver's thread, while the prompt's next layers
compute (the source blocks do not change until the send ends); the receiver hashes on a worker
thread. So that the receiver's hashing overlaps the transfer instead of following it, the sender
announces each layer once all its writes are done (`layer_note`: the layer and its digest, a
progress note of the connector, to receivers naming the "progress-notes" feature); the receiver
checks that layer while later ones fly (`held_layer_digest`), and at the completion hashes only
the layers not yet checked. A layer checked early was complete when its note was sent (the
sender waited for its writes), and nothing else writes a reserved block. Only CPU pools whose
ranks hold the same heads (one rank each side) are digested; a transfer without the envelope is
accepted as before.
"""

from __future__ import annotations

import struct
import zlib

import torch
import xxhash

from splitserve.kvtransfer.layout import KVLayout
from splitserve.kvtransfer.tp_slicing import block_run_arrays

STREAM, XXH3, CRC32 = b"KVd3", b"KVd2", b"KVd1"   # envelope magic: which digest it carries
MAGICS = (STREAM, XXH3, CRC32)
_HEADER = struct.Struct("<4sQI")          # magic, digest, number of (layer, block) pairs
_LAYER_NOTE = struct.Struct("<4sIQ")      # magic, layer, the layer's digest
LAYER_NOTE = b"KVl3"
_MASK = (1 << 64) - 1


def _parts(pool, layout: KVLayout, layer: int, block: int):
    return (pool[layer, block],) if layout.paged else (pool[layer, 0, block], pool[layer, 1, block])


def _bytes(pool: torch.Tensor):
    """The pool's bytes as a numpy array of its shape (the last dimension in bytes): indexing one
    (layer, block) of it costs far less than a tensor's, and each part is contiguous."""
    return pool.view(torch.uint8).numpy()


def block_hash(pool: torch.Tensor, layout: KVLayout, layer: int, block: int, dst_block: int,
               algorithm: bytes = XXH3) -> int:
    """The hash of one layer's K and V bytes of `block`, keyed by (layer, the block it lands in)."""
    return _block_hash(_bytes(pool), layout, layer, block, dst_block, algorithm)


def _block_hash(data, layout: KVLayout, layer: int, block: int, dst_block: int, algorithm: bytes) -> int:
    key = layer * 1_000_003 + dst_block
    if algorithm == CRC32:
        crc = key & 0xFFFFFFFF
        for part in _parts(data, layout, layer, block):
            crc = zlib.crc32(part, crc)
        return crc
    for part in _parts(data, layout, layer, block):
        key = xxhash.xxh3_64_intdigest(part, seed=key)
    return key


def add(total: int, crc: int) -> int:
    return (total + crc) & _MASK


def digest(pool: torch.Tensor, layout: KVLayout, layer: int, src_blocks: list[int], dst_blocks: list[int],
           algorithm: bytes = XXH3) -> int:
    """The sum of `block_hash` over one write's blocks."""
    data, total = _bytes(pool), 0
    for src, dst in zip(src_blocks, dst_blocks):
        total = add(total, _block_hash(data, layout, layer, src, dst, algorithm))
    return total


def granted_digest(pool: torch.Tensor, layout: KVLayout, block_ids: list[int],
                   algorithm: bytes = XXH3) -> tuple[int, int]:
    """(sum, pairs) over every layer of the granted `block_ids`, as they are in `pool` now."""
    total = 0
    for layer in range(layout.num_layers):
        total = add(total, digest(pool, layout, layer, block_ids, block_ids, algorithm))
    return total, layout.num_layers * len(block_ids)


class StreamDigest:
    """The sender's `KVd3` digest of one send: a running xxh3-64 stream per (layer, half)."""

    algorithm = STREAM

    def __init__(self, layout: KVLayout):
        self.layout = layout
        halves = 1 if layout.paged else 2
        self._streams = [[xxhash.xxh3_64(seed=2 * layer + half) for half in range(halves)]
                         for layer in range(layout.num_layers)]
        self.pairs = 0

    def add_write(self, pool: torch.Tensor, layer: int, src_blocks: list[int], dst_blocks: list[int]) -> None:
        """Feed one write's source blocks; a layer's writes come in the grant's block order."""
        runs = list(zip(*block_run_arrays(src_blocks)))
        for stream, span in zip(self._streams[layer], _halves(_bytes(pool), self.layout, layer)):
            for start, count in runs:
                stream.update(span[start:start + count])
        self.pairs += len(dst_blocks)

    def layer_result(self, layer: int) -> int:
        total = 0
        for stream in self._streams[layer]:
            total = add(total, stream.intdigest())
        return total

    def result(self) -> tuple[int, int]:
        total = 0
        for layer in range(len(self._streams)):
            total = add(total, self.layer_result(layer))
        return total, self.pairs


class BlockSumDigest:
    """An earlier sender's digest (`KVd2`, `KVd1`): the sum of `block_hash` over every (layer, block)."""

    def __init__(self, layout: KVLayout, algorithm: bytes = XXH3):
        self.layout, self.algorithm = layout, algorithm
        self.total = self.pairs = 0

    def add_write(self, pool: torch.Tensor, layer: int, src_blocks: list[int], dst_blocks: list[int]) -> None:
        self.total = add(self.total, digest(pool, self.layout, layer, src_blocks, dst_blocks, self.algorithm))
        self.pairs += len(dst_blocks)

    def result(self) -> tuple[int, int]:
        return self.total, self.pairs


def _halves(data, layout: KVLayout, layer: int) -> tuple:
    """The views of one layer whose blocks are contiguous along their first axis: K and V, or the pages."""
    return (data[layer],) if layout.paged else (data[layer, 0], data[layer, 1])


def held_layer_digest(pool: torch.Tensor, layout: KVLayout, block_ids: list[int], layer: int) -> int:
    """The `KVd3` digest of one layer of what the granted `block_ids` hold now."""
    starts, counts = block_run_arrays(block_ids)
    total = 0
    for half, span in enumerate(_halves(_bytes(pool), layout, layer)):
        stream = xxhash.xxh3_64(seed=2 * layer + half)
        for start, count in zip(starts, counts):
            stream.update(span[start:start + count])
        total = add(total, stream.intdigest())
    return total


def held_digest(pool: torch.Tensor, layout: KVLayout, block_ids: list[int], algorithm: bytes,
                checked: dict[int, int] | None = None) -> tuple[int, int]:
    """(digest, pairs) of what the granted `block_ids` hold now, by the envelope's `algorithm`;
    `checked`: `KVd3` layer digests already computed (layer → digest), not hashed again."""
    if algorithm != STREAM:
        return granted_digest(pool, layout, block_ids, algorithm)
    checked, total = checked or {}, 0
    for layer in range(layout.num_layers):
        held = checked.get(layer)
        total = add(total, held if held is not None else held_layer_digest(pool, layout, block_ids, layer))
    return total, layout.num_layers * len(block_ids)


def layer_note(layer: int, digest: int) -> bytes:
    return _LAYER_NOTE.pack(LAYER_NOTE, layer, digest)


def read_layer_note(note: bytes) -> tuple[int, int] | None:
    """(layer, digest) of a `layer_note`; None for anything else."""
    if len(note) != _LAYER_NOTE.size or note[:4] != LAYER_NOTE:
        return None
    _, layer, digest = _LAYER_NOTE.unpack(note)
    return layer, digest


def seal(payload: bytes, total: int, pairs: int, algorithm: bytes = STREAM) -> bytes:
    return _HEADER.pack(algorithm, total, pairs) + payload


def unseal(payload: bytes) -> tuple[tuple[int, int, bytes] | None, bytes]:
    """((sum, pairs, algorithm), inner payload) of a sealed payload; (None, payload) of one without
    the envelope."""
    if len(payload) < _HEADER.size or payload[:4] not in MAGICS:
        return None, payload
    algorithm, total, pairs = _HEADER.unpack_from(payload)
    return (total, pairs, algorithm), payload[_HEADER.size:]
