"""Tensor-parallel head slicing, and every refusal leaving the receiver untouched.

TP=2 → TP=1 (two sender ranks, each holding half the KV heads, write into one
receiver) and TP=1 → TP=2 (one sender writes each receiver rank its heads) must
leave exactly the bytes a TP=1 → TP=1 transfer leaves. Refusals (layout
mismatch, out-of-range block, unreserved block, expired reservation, stale
receiver incarnation) raise a clear error on the sender and write nothing.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from splitserve.kvtransfer.connector import Reservation
from splitserve.kvtransfer.errors import (BlockOutOfRangeError, LayoutMismatchError, NotReservedError,
                                          ReservationExpiredError, TransferError)
from splitserve.kvtransfer.peer import random_pool

SRC, DST = [3, 4, 5, 11, 40], [7, 8, 9, 20, 0]


def test_tp2_to_tp1_equals_tp1_to_tp1(fresh_peers, layout_for):
    full = layout_for()
    reference = random_pool(full, 48, seed=5)
    receiver, rmeta = fresh_peers.start("decode-tp1", full, seed=None)
    ranks = []
    for rank in range(2):
        lay = full.with_tp(rank, 2)
        peer, _ = fresh_peers.start(f"prefill-tp2-r{rank}", lay, seed=None)
        peer.call("load", reference[..., lay.head_start:lay.head_end, :].contiguous())
        peer.call("add_peer", rmeta)
        ranks.append(peer)
    reservation = receiver.call("reserve", "tp21", DST, 30.0, num_senders=2)
    for rank, peer in enumerate(ranks):
        peer.send("send_request", reservation, SRC, DST, b"tok" if rank == 0 else b"")
    for peer in ranks:
        peer.result()
    assert receiver.call("wait_notification", "tp21", 10.0) == b"tok"
    got = receiver.call("pool")
    assert torch.equal(got[:, :, DST].view(torch.uint8), reference[:, :, SRC].view(torch.uint8))
    assert not got[:, :, [b for b in range(48) if b not in DST]].any()
    assert receiver.call("active_reservations") == {}


def test_tp1_to_tp2_equals_tp1_to_tp1(fresh_peers, layout_for):
    full = layout_for("bfloat16")
    sender, _ = fresh_peers.start("prefill-tp1", full, seed=9)
    reference = sender.call("pool")
    receivers = []
    for rank in range(2):
        peer, meta = fresh_peers.start(f"decode-tp2-r{rank}", full.with_tp(rank, 2), seed=None)
        sender.call("add_peer", meta)
        receivers.append(peer)
    reservations = [r.call("reserve", "tp12", DST, 30.0) for r in receivers]
    for reservation in reservations:
        sender.call("send_request", reservation, SRC, DST, b"tok")
    halves = []
    for peer in receivers:
        assert peer.call("wait_notification", "tp12", 10.0) == b"tok"
        halves.append(peer.call("pool"))
        assert peer.call("active_reservations") == {}
    got = torch.cat(halves, dim=-2)
    assert torch.equal(got[:, :, DST].view(torch.uint8), reference[:, :, SRC].view(torch.uint8))


def test_layout_mismatch_names_the_field(pair, peers, layout_for):
    sender, _, _, _ = pair
    _, other = peers.start("decode-other-model", layout_for(block_size=16), seed=None)
    with pytest.raises(LayoutMismatchError, match="block_size"):
        sender.call("add_peer", other)
    _, other = peers.start("decode-other-dtype", layout_for("float16"), seed=None)
    with pytest.raises(LayoutMismatchError, match="dtype"):
        sender.call("add_peer", other)


def test_another_weights_revision_is_refused_by_the_sender_and_by_the_receiver(fresh_peers, layout_for):
    """Revision-safe pairing (issue 41): layouts equal but for the workers' fingerprint (another
    weights revision under one model name). The sender's handshake refuses, naming the weights. A
    sender that writes anyway (metadata forged to carry its own layout hash) is refused by the
    receiver: over TCP at the connection (nothing lands), over NIXL at the completion notification
    (the request fails at once; what the one-sided writes left is never used)."""
    a = layout_for(fingerprint="weights=aaaa tokenizer=t engine=builtin/0.1.0")
    b = layout_for(fingerprint="weights=bbbb tokenizer=t engine=builtin/0.1.0")
    sender, _ = fresh_peers.start("prefill-rev-b", b, seed=3)
    receiver, rmeta = fresh_peers.start("decode-rev-a", a, seed=None)
    with pytest.raises(LayoutMismatchError, match="fingerprint: weights bbbb here vs aaaa on the peer"):
        sender.call("add_peer", rmeta)
    forged = dataclasses.replace(rmeta, layout=b, layout_hash=b.layout_hash())     # no token: not signed
    sender.call("add_peer", forged)
    labels = {"backend": fresh_peers.backend, "reason": "layout_mismatch"}
    before = receiver.call("metric", "splitserve_kv_transfer_failures_total", labels) or 0.0
    reservation = receiver.call("reserve", "rev", DST, 30.0)
    if fresh_peers.backend == "tcp":
        with pytest.raises(LayoutMismatchError, match="layout hash"):
            sender.call("send_request", reservation, SRC, DST, b"tok")
        assert not receiver.call("pool").any(), "a refused sender wrote into the receiver"
        receiver.call("release", "rev")
    else:
        sender.call("send_request", reservation, SRC, DST, b"tok")
        with pytest.raises(LayoutMismatchError, match="another model, configuration or weights revision"):
            receiver.call("wait_notification", "rev", 10.0)
    refusals = receiver.call("metric", "splitserve_kv_transfer_failures_total", labels) - before
    assert refusals >= 1 if fresh_peers.backend == "tcp" else refusals == 1      # TCP: each connection attempt
    assert receiver.call("active_reservations") == {}


def _refused(sender, receiver, error_type, src, dst, reservation):
    receiver.call("fill", 0.0)
    with pytest.raises(error_type) as info:
        sender.call("send_request", reservation, src, dst)
    assert not receiver.call("pool").any(), "a refused transfer wrote into the receiver"
    return str(info.value)


def test_out_of_range_block_is_refused(pair):
    sender, receiver, _, _ = pair
    reservation = receiver.call("reserve", "oob", [1, 2], 30.0)
    message = _refused(sender, receiver, BlockOutOfRangeError, [0, 1], [2, 48], reservation)
    assert "48" in message and "outside" in message
    receiver.call("release", "oob")
    assert receiver.call("active_reservations") == {}


def test_unreserved_block_is_refused(pair):
    sender, receiver, _, _ = pair
    reservation = receiver.call("reserve", "unres", [1, 2], 30.0)
    message = _refused(sender, receiver, NotReservedError, [0, 1], [2, 3], reservation)
    assert "[3]" in message and "not reserved" in message
    receiver.call("release", "unres")


def test_expired_reservation_is_refused_and_released(pair):
    sender, receiver, _, _ = pair
    reservation = receiver.call("reserve", "late", [5, 6], 0.3)
    with pytest.raises(ReservationExpiredError):       # the receiver's own expiry is the event we wait for
        receiver.call("wait_notification", "late", 10.0)
    assert receiver.call("active_reservations") == {}
    _refused(sender, receiver, ReservationExpiredError, [0, 1], [5, 6], reservation)


def test_receiver_validates_a_forged_grant(pair, backend):
    """A grant the receiver never issued: TCP refuses the bytes; NIXL (one-sided) refuses the completion."""
    sender, receiver, _, rmeta = pair
    receiver.call("fill", 0.0)
    real = receiver.call("reserve", "forged", [1, 2], 30.0)
    forged = Reservation("forged", real.agent_name, real.incarnation, (1, 2, 3), real.deadline_unix)
    if backend == "tcp":
        with pytest.raises(NotReservedError, match=r"\[3\]"):
            sender.call("send_request", forged, [0, 1, 2], [1, 2, 3])
        assert not receiver.call("pool").any()
        receiver.call("release", "forged")
    else:
        sender.call("send_request", forged, [0, 1, 2], [1, 2, 3])
        with pytest.raises(NotReservedError, match=r"\[3\]"):
            receiver.call("wait_notification", "forged", 10.0)
    assert receiver.call("active_reservations") == {}


def test_refusals_are_counted(pair, backend):
    sender, receiver, _, _ = pair
    labels = {"backend": backend, "reason": "block_out_of_range"}
    before = sender.call("metric", "splitserve_kv_transfer_failures_total", labels) or 0.0
    reservation = receiver.call("reserve", "counted", [1], 30.0)
    _refused(sender, receiver, BlockOutOfRangeError, [0], [99], reservation)
    receiver.call("release", "counted")
    assert sender.call("metric", "splitserve_kv_transfer_failures_total", labels) == before + 1
    assert issubclass(LayoutMismatchError, TransferError)
