"""The prompt's chained block hashes, computed exactly as the engine computes them.

hash(block i) = SHA-256(hash(block i-1) or 32 zero bytes || len(extra key) as
u32 LE || extra key || token ids as i64 LE). A copy of the engine's
`block_hash.py` so that the router does not import services (DESIGN section 1);
a unit test checks both give the same digests. The worker reports its block
size and extra key through Describe.
"""

from __future__ import annotations

import hashlib
import struct

ROOT_HASH = b"\x00" * 32


def block_hashes(token_ids: list[int], block_size: int, extra_key: bytes = b"") -> list[bytes]:
    """Hashes of every *full* block of `token_ids`."""
    prefix = struct.pack("<I", len(extra_key)) + extra_key
    fmt = f"<{block_size}q"
    parent = ROOT_HASH
    out = []
    for b in range(len(token_ids) // block_size):
        h = hashlib.sha256(parent)
        h.update(prefix)
        h.update(struct.pack(fmt, *token_ids[b * block_size:(b + 1) * block_size]))
        parent = h.digest()
        out.append(parent)
    return out
