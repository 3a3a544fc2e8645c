"""Chained block hashes for the prefix cache and the router's KV index.

hash(block i) = SHA-256(hash(block i-1) || extra key || token ids of block i).
The chain makes a hash identify the whole prefix, not just one block; the extra
key carries anything else that changes the KV (model, dtype, LoRA). SHA-256
rather than Python's `hash()`, which differs between processes.
"""

from __future__ import annotations

import hashlib
import struct

ROOT_HASH = b"\x00" * 32


def hash_block(parent: bytes | None, token_ids: list[int] | tuple[int, ...], extra_key: bytes = b"") -> bytes:
    h = hashlib.sha256()
    h.update(parent or ROOT_HASH)
    h.update(struct.pack("<I", len(extra_key)))
    h.update(extra_key)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def hash_full_blocks(token_ids: list[int], block_size: int, extra_key: bytes = b"",
                     start: list[bytes] | None = None) -> list[bytes]:
    """Hashes of every *full* block of token_ids; `start` continues an existing chain."""
    hashes = list(start or [])
    for b in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[b * block_size:(b + 1) * block_size], extra_key))
    return hashes
