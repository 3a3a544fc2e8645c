"""The session stream's framing: each message is a 4-byte little-endian length, then that many
bytes of a protobuf SessionRequest (frontend to worker) or SessionResponse (worker to frontend).

The session stream carries exactly what a GenerateSession gRPC call carries, over a plain
TCP (or TLS) connection that the frontend's event loop reads itself: no gRPC threads
between the socket and the request, which is most of the frontend's per-message cost
(see session_stream.py).
"""

from __future__ import annotations

import struct

MAX_FRAME_BYTES = 64 * 2**20        # as the worker's gRPC message limit
_LENGTH = struct.Struct("<I")
HEADER_BYTES = _LENGTH.size


class FrameError(Exception):
    """The peer sent something that is not a frame of this protocol."""


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


def frame_length(header: bytes) -> int:
    (length,) = _LENGTH.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {length} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    return length


class FrameBuffer:
    """Bytes in, whole frames out (for a Protocol's data_received)."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._buffer
        buffer += data
        frames, start = [], 0
        while len(buffer) - start >= HEADER_BYTES:
            end = start + HEADER_BYTES + frame_length(buffer[start:start + HEADER_BYTES])
            if len(buffer) < end:
                break
            frames.append(bytes(buffer[start + HEADER_BYTES:end]))
            start = end
        if start:
            del buffer[:start]
        return frames

    @property
    def empty(self) -> bool:
        return not self._buffer
