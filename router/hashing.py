"""The prompt's chained block hashes, computed exactly as the engine computes them.

hash(block i) = SHA-256(hash(block i-1) or 32 zero bytes || len(extra key) as
u32 LE || extra key || token ids as i64 LE). A copy of the engine's
`block_hash.py` so that the router does not import services (DESIGN section 1);
a unit test checks both give the same digests. The worker reports its block
size and extra key through Describe.

Speed (the router hashes every prompt on the request path): the full blocks'
token ids are packed to bytes by one struct call, then each block is one
hashlib call over parent || prefix || a slice of those bytes.
"""

from __future__ import annotations

import hashlib
import struct

ROOT_HASH = b"\x00" * 32


def block_hashes(token_ids: list[int], block_size: int, extra_key: bytes = b"") -> list[bytes]:
    """Hashes of every *full* block of `token_ids`."""
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    num_tokens = num_blocks * block_size
    raw = struct.pack(f"<{num_tokens}q", *token_ids[:num_tokens])
    prefix = struct.pack("<I", len(extra_key)) + extra_key
    step = block_size * 8
    sha256 = hashlib.sha256
    parent = ROOT_HASH
    out = []
    append = out.append
    for off in range(0, num_tokens * 8, step):
        parent = sha256(parent + prefix + raw[off:off + step]).digest()
        append(parent)
    return out
