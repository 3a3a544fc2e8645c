"""The fast paths, on both backends: cached per-peer state, coalesced runs and many-run
(scattered) transfers.

NIXL writes through descriptor lists prepared once per (layer, remote agent); TCP
keeps one connection per peer incarnation and gathers/scatters runs with
sendmsg/recvmsg_into in batches of at most IOV_MAX views. A restarted receiver
must never be written through the state cached for its previous incarnation,
and transfers with more runs than one system call takes, or whose blocks are adjacent
on one side only, must stay byte-exact.
"""

from __future__ import annotations

import random

import pytest
import torch

from splitserve.kvtransfer.errors import StalePeerError


def test_restarted_peer_gets_fresh_cached_state(fresh_peers, layout_for, assert_written):
    layout = layout_for()
    sender, _ = fresh_peers.start("prefill-c1", layout, seed=11)
    receiver, old_meta = fresh_peers.start("decode-c1", layout, seed=None)
    sender.call("add_peer", old_meta)
    old = receiver.call("reserve", "before", [0, 1, 2, 5], 30.0)
    sender.call("send_request", old, [3, 4, 5, 9], [0, 1, 2, 5], b"a")
    assert receiver.call("wait_notification", "before", 10.0) == b"a"
    assert sender.call("cached_peer_state") == [("decode-c1", old_meta.incarnation)]

    receiver.kill()
    restarted, new_meta = fresh_peers.start("decode-c1", layout, seed=None)
    sender.call("add_peer", new_meta)
    assert sender.call("cached_peer_state") == []          # the old incarnation's state is gone
    with pytest.raises(StalePeerError):
        sender.call("send_request", old, [3], [0])
    src, dst = [3, 4, 5, 9, 40, 41], [0, 1, 2, 5, 47, 46]
    reservation = restarted.call("reserve", "after", dst, 30.0)
    sender.call("send_request", reservation, src, dst, b"b")
    assert restarted.call("wait_notification", "after", 10.0) == b"b"
    assert sender.call("cached_peer_state") == [("decode-c1", new_meta.incarnation)]
    assert_written(sender.call("pool"), restarted.call("pool"), src, dst)
    assert restarted.call("active_reservations") == {}


def test_more_runs_than_one_system_call_takes_stay_byte_exact(fresh_peers, layout_for, assert_written):
    """1100 scattered blocks: 2200 single-block runs (K and V), over twice IOV_MAX (1024)."""
    layout = layout_for("bfloat16")
    num_blocks = 1200
    sender, _ = fresh_peers.start("prefill-s1", layout, seed=5, num_blocks=num_blocks)
    receiver, meta = fresh_peers.start("decode-s1", layout, seed=None, num_blocks=num_blocks)
    sender.call("add_peer", meta)
    rng = random.Random(3)
    src = rng.sample(range(40, num_blocks), 1060)
    dst = rng.sample(range(1150), 1060)
    src[100:100] = range(0, 40)                    # one long run among the scattered ones
    dst[100:100] = range(1150, 1190)
    assert len(set(dst)) == len(dst)
    reservation = receiver.call("reserve", "many-runs", dst, 60.0)
    sender.call("send_request", reservation, src, dst, b"tok")
    assert receiver.call("wait_notification", "many-runs", 20.0) == b"tok"
    assert_written(sender.call("pool"), receiver.call("pool"), src, dst)
    assert receiver.call("active_reservations") == {}


def test_writes_larger_than_the_socket_buffers(fresh_peers, layout_for):
    """Whole-pool layers (several MiB each) posted back to back, so sends finish on the I/O thread."""
    layout = layout_for("float32", head_dim=64)          # 8 KiB blocks (K or V)
    num_blocks = 1024                                     # 16 MiB per layer
    sender, _ = fresh_peers.start("prefill-b1", layout, seed=8, num_blocks=num_blocks)
    receiver, meta = fresh_peers.start("decode-b1", layout, seed=None, num_blocks=num_blocks)
    sender.call("add_peer", meta)
    blocks = list(range(num_blocks))
    reversed_blocks = blocks[::-1]
    reservation = receiver.call("reserve", "big", blocks, 60.0)
    sender.call("send_request", reservation, blocks, reversed_blocks, b"big")
    assert receiver.call("wait_notification", "big", 30.0) == b"big"
    got, want = receiver.call("pool"), sender.call("pool")
    assert torch.equal(got[:, :, reversed_blocks].view(torch.uint8), want[:, :, blocks].view(torch.uint8))
    assert receiver.call("active_reservations") == {}


# (src blocks, dst blocks) stretches: adjacent on both sides (one span), on the source side only,
# on the destination side only, reversed, single, and a run that ends at the K/V boundary.
PARTLY_ADJACENT = [
    (range(0, 4), range(0, 4)),
    (range(10, 13), [30, 32, 34]),
    ([44, 46, 48], range(20, 23)),
    ([40, 39, 38], range(40, 43)),
    ([5], [5]),
    (range(20, 25), range(50, 55)),
    ([55, 56], [10, 11]),
    ([62, 63], [62, 63]),
]


def test_partly_adjacent_blocks_are_byte_exact_with_and_without_coalescing(fresh_peers, layout_for,
                                                                           assert_written):
    layout = layout_for("float16")
    sender, _ = fresh_peers.start("prefill-pa", layout, seed=4, num_blocks=64)
    receiver, meta = fresh_peers.start("decode-pa", layout, seed=None, num_blocks=64)
    sender.call("add_peer", meta)
    src = [b for s, _ in PARTLY_ADJACENT for b in s]
    dst = [b for _, d in PARTLY_ADJACENT for b in d]
    assert len(set(src)) == len(src) == len(dst) == len(set(dst))
    for coalesce in (True, False):
        for peer in (sender, receiver):
            peer.call("set_coalesce", coalesce)
        receiver.call("fill", 0.0)
        rid = f"partly-adjacent-{coalesce}"
        reservation = receiver.call("reserve", rid, dst, 30.0)
        sender.call("send_request", reservation, src, dst, b"pa")
        assert receiver.call("wait_notification", rid, 10.0) == b"pa"
        assert_written(sender.call("pool"), receiver.call("pool"), src, dst)
    assert receiver.call("active_reservations") == {}
