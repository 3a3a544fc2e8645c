"""The session stream's framing: frames split and joined arbitrarily by TCP come out whole."""

from __future__ import annotations

import struct

import pytest

from splitserve.proto.v1 import worker_pb2
from splitserve.services.worker_protocol.framing import MAX_FRAME_BYTES, FrameBuffer, FrameError, frame


def test_frames_come_out_whole_however_the_bytes_are_cut():
    messages = [worker_pb2.SessionRequest(abort_request_id=f"r{i}" * i).SerializeToString() for i in range(6)]
    stream = b"".join(frame(m) for m in messages)
    for cut in (1, 3, 4, 5, 7, len(stream)):
        buffer, out = FrameBuffer(), []
        for start in range(0, len(stream), cut):
            out += buffer.feed(stream[start:start + cut])
        assert out == messages, cut
        assert buffer.empty


def test_a_partial_frame_waits_for_the_rest():
    buffer = FrameBuffer()
    data = frame(b"hello")
    assert buffer.feed(data[:6]) == [] and not buffer.empty
    assert buffer.feed(data[6:]) == [b"hello"] and buffer.empty


def test_an_oversized_length_is_refused_before_buffering_it():
    with pytest.raises(FrameError, match="over the"):
        FrameBuffer().feed(struct.pack("<I", MAX_FRAME_BYTES + 1))
