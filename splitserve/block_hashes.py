"""Chained block hashes: the one function the engine's prefix cache and the router's KV index share.

hash(block i) = SHA-256(hash(block i-1) or 32 zero bytes || len(extra key) as
u32 LE || extra key || token ids as i64 LE). The chain makes a hash identify the
whole prefix, not just one block; the extra key carries anything else that
changes the KV (model, dtype, LoRA). SHA-256 rather than Python's `hash()`, which
differs between processes. The engine imports this module (the router imports
nothing of services, DESIGN section 1); a worker reports its block size and extra
key through Describe.

Speed (the router hashes every prompt on the request path): the full blocks'
token ids are packed to bytes by one struct call, then each block is one
hashlib call over parent || prefix || a slice of those bytes. `ChainHasher`
(what RouterCore uses) adds a memo, so that a prefix that recurs is hashed
once, not once per request.
"""

from __future__ import annotations

import hashlib
import struct
from itertools import islice

ROOT_HASH = b"\x00" * 32
SALT_MARK = b"\x00cache_salt\x00"


def salted_key(extra_key: bytes, cache_salt: str) -> bytes:
    """The extra key of a request with vLLM's `cache_salt`: its blocks hash apart from every
    other salt's (and from unsalted ones), so they are shared only within one salt. "" is
    no salt: the key is unchanged. The engine's prefix cache and the router both call this."""
    if not cache_salt:
        return extra_key
    salt = cache_salt.encode()
    return extra_key + SALT_MARK + struct.pack("<I", len(salt)) + salt


def hash_block(parent: bytes | None, token_ids: list[int] | tuple[int, ...], extra_key: bytes = b"") -> bytes:
    """The hash of one block whose parent block hashed to `parent` (None: the first block)."""
    packed = struct.pack("<I", len(extra_key)) + extra_key + struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.sha256((parent or ROOT_HASH) + packed).digest()


def block_hashes(token_ids: list[int], block_size: int, extra_key: bytes = b"",
                 start: list[bytes] | None = None) -> list[bytes]:
    """Hashes of every *full* block of `token_ids`; `start` (the hashes of its first blocks,
    as a sequence that grows keeps them) continues that chain instead of hashing them again."""
    num_blocks = len(token_ids) // block_size
    first = len(start) if start else 0
    out = list(start) if start else []
    if num_blocks <= first:
        return out
    num_tokens = num_blocks * block_size
    raw = struct.pack(f"<{num_tokens - first * block_size}q", *token_ids[first * block_size:num_tokens])
    prefix = struct.pack("<I", len(extra_key)) + extra_key
    step = block_size * 8
    sha256 = hashlib.sha256
    parent = out[-1] if out else ROOT_HASH
    append = out.append
    for off in range(0, len(raw), step):
        parent = sha256(parent + prefix + raw[off:off + step]).digest()
        append(parent)
    return out


class ChainHasher:
    """`block_hashes` with a memo for prefixes that recur (a tenant's system prompt, a document).

    SHA-256 of the blocks is about half of a routing decision. The memo maps
    (parent hash, extra key, a block's packed token ids) to that block's hash, so a
    block seen before costs a dict lookup instead. Only prompts whose first block
    has been seen before are remembered (a prompt that never recurs would pay for
    64 insertions and gain nothing), and the first miss ends the lookups (every
    later block's parent is new, so it cannot be in the memo). At most `capacity`
    blocks are kept, oldest first out. The result is always exactly `block_hashes`.
    """

    def __init__(self, capacity: int = 65536):
        self.capacity = capacity
        self._memo: dict[tuple[bytes, bytes, bytes], bytes] = {}
        self._first_seen: dict[tuple[bytes, bytes], None] = {}     # first blocks seen once, oldest first

    def __call__(self, token_ids: list[int], block_size: int, extra_key: bytes = b"") -> list[bytes]:
        num_blocks = len(token_ids) // block_size
        if num_blocks == 0:
            return []
        num_tokens = num_blocks * block_size
        raw = struct.pack(f"<{num_tokens}q", *token_ids[:num_tokens])
        step, end = block_size * 8, num_tokens * 8
        memo = self._memo
        get = memo.get
        parent, off = ROOT_HASH, 0
        out: list[bytes] = []
        while off < end:                                   # blocks seen before: lookups
            h = get((parent, extra_key, raw[off:off + step]))
            if h is None:
                break
            parent = h
            out.append(h)
            off += step
        if off == end:
            return out
        prefix = struct.pack("<I", len(extra_key)) + extra_key
        sha256 = hashlib.sha256
        append = out.append
        if off == 0 and not self._seen_twice(extra_key, raw[:step]):
            for off in range(0, end, step):               # a first sighting: hashed only, as block_hashes
                parent = sha256(parent + prefix + raw[off:off + step]).digest()
                append(parent)
            return out
        for off in range(off, end, step):                 # the rest: hashed and remembered
            block = raw[off:off + step]
            h = memo[(parent, extra_key, block)] = sha256(parent + prefix + block).digest()
            parent = h
            append(h)
        if len(memo) > self.capacity:
            for key in list(islice(memo, len(memo) - self.capacity)):
                del memo[key]
        return out

    def _seen_twice(self, extra_key: bytes, first_block: bytes) -> bool:
        key = (extra_key, first_block)
        if key in self._first_seen:
            return True
        self._first_seen[key] = None
        if len(self._first_seen) > self.capacity:
            del self._first_seen[next(iter(self._first_seen))]
        return False
