"""vLLM's paged KV layout (`paged-heads-kv-v1`) between two real processes, on both backends.

A paged pool is `[layers][blocks][local_kv_heads][2][block_size][head_dim]`: blocks are on
dimension 1 and heads on dimension 2 (layout.py). Writes of scattered and consecutive blocks,
with and without coalescing, must land byte-exactly and touch no other block; TP=2 → TP=1 and
TP=1 → TP=2 must leave what TP=1 → TP=1 leaves; FP8 pools move like any other; a paged peer
and a built-in (layer-major) peer refuse each other at the handshake, naming `layout`.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from splitserve.kvtransfer.errors import LayoutMismatchError
from splitserve.kvtransfer.layout import PAGED_LAYOUT
from splitserve.kvtransfer.peer import random_pool

NUM_BLOCKS = 48                                  # conftest.NUM_BLOCKS
SRC, DST = [3, 4, 5, 11, 40, 41, 42, 7], [7, 8, 9, 20, 0, 1, 2, 47]   # runs and single blocks, both sides

_ids = itertools.count()


def assert_pages_written(src_pool: torch.Tensor, dst_pool: torch.Tensor, src: list[int], dst: list[int]) -> None:
    """dst pages hold the src pages' bytes exactly, in every layer; every other receiver page is still zero."""
    assert torch.equal(dst_pool[:, dst].view(torch.uint8), src_pool[:, src].view(torch.uint8))
    untouched = [b for b in range(dst_pool.shape[1]) if b not in dst]
    assert not dst_pool[:, untouched].view(torch.uint8).any()


def transfer(sender, receiver, src: list[int], dst: list[int]) -> None:
    rid = f"paged-{next(_ids)}"
    receiver.call("fill", 0.0)
    reservation = receiver.call("reserve", rid, dst, 30.0)
    sender.call("send_request", reservation, src, dst, b"tok")
    assert receiver.call("wait_notification", rid, 10.0) == b"tok"
    assert receiver.call("active_reservations") == {}


@pytest.fixture(scope="module")
def paged_pair(peers, layout_for):
    layout = layout_for("bfloat16", layout=PAGED_LAYOUT)
    sender, _ = peers.start("prefill-paged", layout, seed=3)
    receiver, rmeta = peers.start("decode-paged", layout, seed=None)
    sender.call("add_peer", rmeta)
    return sender, receiver, rmeta


@pytest.mark.parametrize("coalesce", [True, False])
@pytest.mark.parametrize("src, dst", [(SRC, DST), (list(range(10, 30)), list(range(20, 40))), ([47], [0])],
                         ids=["scattered", "consecutive", "single"])
def test_paged_blocks_land_byte_exact(paged_pair, src, dst, coalesce):
    sender, receiver, _ = paged_pair
    sender.call("set_coalesce", coalesce)
    receiver.call("set_coalesce", coalesce)
    transfer(sender, receiver, src, dst)
    assert_pages_written(sender.call("pool"), receiver.call("pool"), src, dst)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_paged_pool_moves_byte_exact(peers, layout_for, dtype):
    layout = layout_for(dtype, layout=PAGED_LAYOUT)
    sender, _ = peers.start(f"prefill-{dtype}", layout, seed=4)
    receiver, rmeta = peers.start(f"decode-{dtype}", layout, seed=None)
    sender.call("add_peer", rmeta)
    transfer(sender, receiver, SRC, DST)
    assert_pages_written(sender.call("pool"), receiver.call("pool"), SRC, DST)


def test_paged_and_layer_major_peers_refuse_each_other(paged_pair, peers, layout_for):
    sender, _, paged_meta = paged_pair
    builtin, builtin_meta = peers.start("decode-layer-major", layout_for("bfloat16"), seed=None)
    with pytest.raises(LayoutMismatchError, match="layout: local 'paged-heads-kv-v1' vs peer 'layer-major-v1'"):
        sender.call("add_peer", builtin_meta)
    with pytest.raises(LayoutMismatchError, match="layout: local 'layer-major-v1' vs peer 'paged-heads-kv-v1'"):
        builtin.call("add_peer", paged_meta)


def test_paged_tp2_to_tp1_equals_tp1_to_tp1(fresh_peers, layout_for):
    """In FP8: the receiver's scatter copies bytes (torch has no FP8 index_copy on the CPU)."""
    full = layout_for("float8_e4m3fn", layout=PAGED_LAYOUT)
    reference = random_pool(full, NUM_BLOCKS, seed=5)
    receiver, rmeta = fresh_peers.start("decode-paged-tp1", full, seed=None)
    ranks = []
    for rank in range(2):
        lay = full.with_tp(rank, 2)
        peer, _ = fresh_peers.start(f"prefill-paged-tp2-r{rank}", lay, seed=None)
        peer.call("load", reference[:, :, lay.head_start:lay.head_end].contiguous())
        peer.call("add_peer", rmeta)
        ranks.append(peer)
    reservation = receiver.call("reserve", "paged-tp21", DST, 30.0, num_senders=2)
    for rank, peer in enumerate(ranks):
        peer.send("send_request", reservation, SRC, DST, b"tok" if rank == 0 else b"")
    for peer in ranks:
        peer.result()
    assert receiver.call("wait_notification", "paged-tp21", 10.0) == b"tok"
    assert_pages_written(reference, receiver.call("pool"), SRC, DST)
    assert receiver.call("active_reservations") == {}


def test_paged_tp1_to_tp2_equals_tp1_to_tp1(fresh_peers, layout_for):
    full = layout_for("bfloat16", layout=PAGED_LAYOUT)
    sender, _ = fresh_peers.start("prefill-paged-tp1", full, seed=9)
    reference = sender.call("pool")
    receivers = []
    for rank in range(2):
        peer, meta = fresh_peers.start(f"decode-paged-tp2-r{rank}", full.with_tp(rank, 2), seed=None)
        sender.call("add_peer", meta)
        receivers.append(peer)
    reservations = [r.call("reserve", "paged-tp12", DST, 30.0) for r in receivers]
    for reservation in reservations:
        sender.call("send_request", reservation, SRC, DST, b"tok")
    halves = []
    for peer in receivers:
        assert peer.call("wait_notification", "paged-tp12", 10.0) == b"tok"
        halves.append(peer.call("pool"))
        assert peer.call("active_reservations") == {}
    assert_pages_written(reference, torch.cat(halves, dim=2), SRC, DST)
