"""Binary encodings shared by the backends: the completion notification and TCP frames.

Fixed-size big-endian headers (struct) followed by variable parts; block id
lists are uint32 arrays. A frame never carries a string-keyed dict. New fields
are only ever appended (the magic carries the version).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

NOTIFY_MAGIC = b"SKN1"
# A notification whose payload starts with this is a progress note (Connector.post_progress): the
# receiver keeps it aside and the reservation stays open. Only sent to agents naming the
# "progress-notes" feature (an earlier receiver would take it for the completion).
PROGRESS_MAGIC = b"SKP1"
# Appended to a notification after its payload: the sender's layout hash (64 hex digits), so a
# receiver refuses KV a sender of another layout or fingerprint wrote (earlier receivers ignore it).
SENDER_LAYOUT_MAGIC = b"SKL1"
FRAME_MAGIC = b"SKF1"
REPLY_MAGIC = b"SKR1"

KIND_WRITE = 1
KIND_NOTIFY = 2

# magic, kind, seq, len(request_id), len(incarnation), layer, head_lo, head_hi, num_blocks, payload_len
FRAME_HEADER = struct.Struct("!4sBQHHIIIIQ")
# magic, seq, code (0 = ok), len(message)
REPLY_HEADER = struct.Struct("!4sQBI")
# magic, len(request_id), len(incarnation), num_blocks, len(payload)
NOTIFY_HEADER = struct.Struct("!4sHHII")
# TCP connection opening (kvtransfer/auth.py): the receiver's challenge, the sender's answer
CHALLENGE_MAGIC = b"SKC1"
HELLO_MAGIC = b"SKH1"
CHALLENGE = struct.Struct("!4s32s")          # magic, nonce
HELLO = struct.Struct("!4s64s32s")           # magic, sender's layout hash (hex), tag


def _ids(block_ids: list[int] | tuple[int, ...]) -> bytes:
    return np.asarray(block_ids, dtype=">u4").tobytes()


def _decode_ids(data: bytes | memoryview) -> list[int]:
    return np.frombuffer(data, dtype=">u4").astype(np.int64).tolist()


@dataclass(frozen=True, slots=True)
class Notification:
    """Sent after a request's writes: which receiver incarnation, which blocks, what payload."""

    request_id: str
    incarnation: str
    block_ids: tuple[int, ...]
    payload: bytes
    sender_layout: str = ""    # the sender's layout hash; "" from a sender from before it was sent

    def encode(self) -> bytes:
        rid, inc = self.request_id.encode(), self.incarnation.encode()
        head = NOTIFY_HEADER.pack(NOTIFY_MAGIC, len(rid), len(inc), len(self.block_ids), len(self.payload))
        layout = SENDER_LAYOUT_MAGIC + self.sender_layout.encode() if self.sender_layout else b""
        return b"".join((head, rid, inc, _ids(self.block_ids), self.payload, layout))

    @classmethod
    def decode(cls, data: bytes) -> Notification:
        magic, n_rid, n_inc, n_blocks, n_payload = NOTIFY_HEADER.unpack_from(data)
        if magic != NOTIFY_MAGIC:
            raise ValueError("not a splitserve KV notification")
        at = NOTIFY_HEADER.size
        rid = data[at:at + n_rid].decode()
        at += n_rid
        inc = data[at:at + n_inc].decode()
        at += n_inc
        block_ids = tuple(_decode_ids(data[at:at + 4 * n_blocks]))
        at += 4 * n_blocks
        payload = bytes(data[at:at + n_payload])
        if len(payload) != n_payload:
            raise ValueError("truncated KV notification")
        at += n_payload
        layout = ""
        if data[at:at + len(SENDER_LAYOUT_MAGIC)] == SENDER_LAYOUT_MAGIC:
            at += len(SENDER_LAYOUT_MAGIC)
            layout = bytes(data[at:at + 64]).decode("ascii", "replace")
        return cls(rid, inc, block_ids, payload, layout)


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """One TCP frame: a layer write (payload = K rows then V rows) or a notification."""

    kind: int
    seq: int
    request_id: str
    incarnation: str           # the receiver incarnation the sender believes it talks to
    layer: int
    head_lo: int               # model-global KV heads [head_lo, head_hi) in the payload
    head_hi: int
    block_ids: tuple[int, ...]  # destination blocks (write) or all blocks written (notify)
    payload_len: int

    def encode(self) -> bytes:
        rid, inc = self.request_id.encode(), self.incarnation.encode()
        head = FRAME_HEADER.pack(FRAME_MAGIC, self.kind, self.seq, len(rid), len(inc), self.layer,
                                 self.head_lo, self.head_hi, len(self.block_ids), self.payload_len)
        return b"".join((head, rid, inc, _ids(self.block_ids)))

    @staticmethod
    def variable_len(fixed: bytes) -> int:
        """Length of the variable part that follows a fixed header."""
        _, _, _, n_rid, n_inc, _, _, _, n_blocks, _ = FRAME_HEADER.unpack(fixed)
        return n_rid + n_inc + 4 * n_blocks

    @classmethod
    def decode(cls, fixed: bytes, variable: bytes) -> FrameHeader:
        magic, kind, seq, n_rid, n_inc, layer, lo, hi, n_blocks, payload_len = FRAME_HEADER.unpack(fixed)
        if magic != FRAME_MAGIC:
            raise ValueError("not a splitserve KV frame")
        rid = variable[:n_rid].decode()
        inc = variable[n_rid:n_rid + n_inc].decode()
        block_ids = tuple(_decode_ids(variable[n_rid + n_inc:]))
        return cls(kind, seq, rid, inc, layer, lo, hi, block_ids, payload_len)


def encode_reply(seq: int, code: int, message: str = "") -> bytes:
    msg = message.encode()
    return REPLY_HEADER.pack(REPLY_MAGIC, seq, code, len(msg)) + msg
