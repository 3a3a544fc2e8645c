"""Pure pieces of kvtransfer: layout hash/handshake, run coalescing, head slicing, wire codecs,
and the receiver's reservation table (bounds, ownership, deadline, leak check)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from splitserve.errors import RecoverableError
from splitserve.kvtransfer.connector import AgentMetadata
from splitserve.kvtransfer.errors import (BlockOutOfRangeError, NotReservedError, ReservationExpiredError,
                                          StalePeerError, TransferError)
from splitserve.kvtransfer.layout import KVLayout
from splitserve.kvtransfer.reservations import ReservationTable
from splitserve.kvtransfer.tp_slicing import (block_runs, gather_slice, head_slice, joint_runs, row_descriptors,
                                              scatter_slice)
from splitserve.kvtransfer.frames import FRAME_HEADER, KIND_WRITE, FrameHeader, Notification
from splitserve.testing.clock import FakeClock

LAYOUT = KVLayout("m", "bfloat16", num_layers=2, num_kv_heads=4, head_dim=8, block_size=4)


def test_hash_ignores_tp_but_not_model_fields():
    assert LAYOUT.layout_hash() == LAYOUT.with_tp(1, 2).layout_hash()
    other = KVLayout("m", "float16", 2, 4, 8, 8)
    assert other.layout_hash() != LAYOUT.layout_hash()
    assert LAYOUT.compare(other) == ["dtype", "block_size"]
    assert "block_size: local 4 vs peer 8" in LAYOUT.describe_mismatch(other)


def test_tp_rank_geometry_and_validation():
    rank1 = LAYOUT.with_tp(1, 2)
    assert (rank1.head_start, rank1.head_end, rank1.num_local_kv_heads) == (2, 4, 2)
    assert rank1.pool_shape(10) == (2, 2, 10, 4, 2, 8)
    with pytest.raises(ValueError, match="split evenly"):
        LAYOUT.with_tp(0, 3)
    with pytest.raises(ValueError, match="dtype"):
        KVLayout("m", "int8", 1, 1, 1, 1)


def test_runs_coalesce_only_where_both_sides_are_consecutive():
    assert joint_runs([0, 1, 2, 7], [5, 6, 9, 10]) == [(0, 5, 2), (2, 9, 1), (7, 10, 1)]
    assert block_runs([3, 4, 5, 9, 2, 3]) == [(3, 3), (9, 1), (2, 2)]


def test_head_slices_between_tp_ranks():
    full, r0, r1 = LAYOUT, LAYOUT.with_tp(0, 2), LAYOUT.with_tp(1, 2)
    assert head_slice(full, full).whole_rows
    hs = head_slice(r1, full)
    assert (hs.lo, hs.hi, hs.src_offset, hs.dst_offset, hs.whole_rows) == (2, 4, 0, 2, False)
    hs = head_slice(full, r1)
    assert (hs.src_offset, hs.dst_offset) == (2, 0)
    assert head_slice(r0, r1) is None


def test_gather_scatter_and_row_descriptors_agree():
    full, r1 = LAYOUT, LAYOUT.with_tp(1, 2)
    src = torch.randn(full.pool_shape(6)).to(torch.bfloat16)
    dst = torch.zeros(r1.pool_shape(6), dtype=torch.bfloat16)
    hs = head_slice(full, r1)
    scatter_slice(dst, 1, [5, 0], hs, gather_slice(src, 1, [1, 2], hs))
    assert torch.equal(dst[1, :, [5, 0]], src[1, :, [1, 2], :, 2:])
    # One-sided path: copy the row descriptors byte by byte and compare with the same result.
    dst2 = torch.zeros_like(dst)
    src_bytes, dst_bytes = src.view(torch.uint8).reshape(-1).numpy(), dst2.view(torch.uint8).reshape(-1).numpy()
    sk = src[1].data_ptr() - src.data_ptr()
    dk = dst2[1].data_ptr() - dst2.data_ptr()
    s_rows = row_descriptors(sk, sk + 6 * full.block_bytes, [1, 2], full, hs.src_offset, hs.num_heads)
    d_rows = row_descriptors(dk, dk + 6 * r1.block_bytes, [5, 0], r1, hs.dst_offset, hs.num_heads)
    assert s_rows.shape == d_rows.shape == (2 * 2 * 4, 2)
    for (sa, n), (da, m) in zip(s_rows, d_rows):
        assert n == m
        dst_bytes[da:da + m] = src_bytes[sa:sa + n]
    assert torch.equal(dst2, dst)


def test_wire_roundtrips():
    note = Notification("req-1", "abc", (3, 1, 2), b"\x00tok")
    assert Notification.decode(note.encode()) == note
    frame = FrameHeader(KIND_WRITE, 7, "req-1", "inc", 3, 0, 4, (9, 8), 4096)
    raw = frame.encode()
    fixed, variable = raw[:FRAME_HEADER.size], raw[FRAME_HEADER.size:]
    assert FrameHeader.variable_len(fixed) == len(variable)
    assert FrameHeader.decode(fixed, variable) == frame
    with pytest.raises(ValueError):
        Notification.decode(b"XXXX" + note.encode()[4:])


def test_metadata_roundtrips_through_bytes():
    meta = AgentMetadata("decode-0", "inc", "nixl", "", LAYOUT, LAYOUT.layout_hash(), 10, (1, 2), "cpu", b"\x00\xff")
    assert AgentMetadata.from_bytes(meta.to_bytes()) == meta
    featured = dataclasses.replace(meta, features=("digest-stream",))
    assert AgentMetadata.from_bytes(featured.to_bytes()) == featured


def test_metadata_of_an_earlier_or_a_later_agent_still_parses():
    """A rolling update mixes agents: an earlier one's metadata has no `features` (it understands
    none), a later one's may carry fields this build does not know (ignored, not refused)."""
    meta = AgentMetadata("decode-0", "inc", "tcp", "h:1", LAYOUT, LAYOUT.layout_hash(), 10, (1, 2), "cpu",
                         features=("digest-stream",))
    values = json.loads(meta.to_bytes())
    del values["features"]
    assert AgentMetadata.from_bytes(json.dumps(values).encode()).features == ()
    values.update(features=["digest-stream", "from-the-future"], fingerprint_of_the_future="x")
    later = AgentMetadata.from_bytes(json.dumps(values).encode())
    assert later.features == ("digest-stream", "from-the-future") and later.signed_fields() == meta.signed_fields()


def test_errors_are_recoverable_and_pickle():
    import pickle
    error = pickle.loads(pickle.dumps(NotReservedError("blocks [3] are not reserved")))
    assert isinstance(error, TransferError) and isinstance(error, RecoverableError)
    assert str(error) == "blocks [3] are not reserved"


class TestReservationTable:
    def test_write_checks(self):
        table = ReservationTable(num_blocks=8, incarnation="inc")
        table.reserve("a", [1, 2], ttl_s=60)
        with pytest.raises(BlockOutOfRangeError, match="outside"):
            table.begin_write("a", "inc", (1, 8), source=1)
        with pytest.raises(NotReservedError, match=r"\[3\]"):
            table.begin_write("a", "inc", (1, 3), source=1)
        with pytest.raises(NotReservedError, match="no reservation"):
            table.begin_write("b", "inc", (1,), source=1)
        with pytest.raises(StalePeerError, match="incarnation"):
            table.begin_write("a", "old", (1,), source=1)
        with pytest.raises(ValueError, match="already reserved"):
            table.reserve("c", [2, 3], ttl_s=60)
        with pytest.raises(BlockOutOfRangeError):
            table.reserve("c", [8], ttl_s=60)
        table.begin_write("a", "inc", (1, 2), source=1)
        table.end_write("a")
        table.complete("a", "inc", (1, 2), b"tok")
        assert table.take_result("a") == b"tok"
        assert table.active() == {}

    def test_expiry_releases_blocks_but_waits_for_inflight_writes(self):
        clock = FakeClock(100.0)
        table = ReservationTable(num_blocks=8, incarnation="inc", clock=clock)
        table.reserve("a", [1], ttl_s=0.01)
        table.begin_write("a", "inc", (1,), source=1)
        clock.advance(0.02)                           # past the deadline
        assert table.active() == {"a": (1,)}          # a write in progress holds off expiry
        table.end_write("a")
        assert table.active() == {}
        table.reserve("b", [1], ttl_s=60)               # the block can be granted again
        with pytest.raises(ReservationExpiredError):
            table.take_result("a")
        with pytest.raises(NotReservedError):
            table.take_result("a")

    def test_multi_sender_completion_and_source_loss(self):
        table = ReservationTable(num_blocks=8, incarnation="inc")
        table.reserve("tp", [0, 1], ttl_s=60, num_senders=2)
        table.complete("tp", "inc", (0, 1), b"")
        assert table.take_result("tp") is None
        table.complete("tp", "inc", (0, 1), b"tok")
        assert table.take_result("tp") == b"tok"
        table.reserve("x", [2], ttl_s=60)
        table.begin_write("x", "inc", (2,), source="conn")
        table.end_write("x")
        assert table.fail_from_source("conn", lambda rid: TransferError(rid)) == ["x"]
        with pytest.raises(TransferError):
            table.take_result("x")
        assert table.active() == {}
