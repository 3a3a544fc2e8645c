"""Pure pieces of the fast paths: vectorised run coalescing (and that it moves exactly the bytes of
the blocks, in order), block-id validation, huge-page advice, and the TCP backend's gather
(sendmsg) / scatter (recvmsg_into) helpers."""

from __future__ import annotations

import asyncio
import random
import socket
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.kvtransfer.connector import block_ids_array
from splitserve.kvtransfer.memory import HUGE_PAGE, advise_huge_pages, empty_pool
from splitserve.kvtransfer.tcp import IOV_MAX, _batch_end, _Frame, _recv_views
from splitserve.kvtransfer.tp_slicing import (block_run_arrays, block_runs, joint_runs, layer_spans,
                                               run_arrays, run_length_histogram, side_runs)


def test_vectorised_runs_match_the_reference():
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(1, 40)
        src = [rng.choice([rng.randint(0, 60), None]) for _ in range(n)]
        # Mix consecutive stretches with jumps on either side.
        src = [s if s is not None else (src[i - 1] + 1 if i and src[i - 1] is not None else 0)
               for i, s in enumerate(src)]
        dst = [rng.randint(0, 60) if rng.random() < 0.3 else i for i in range(n)]
        s0, d0, counts = run_arrays(src, dst)
        assert list(zip(s0.tolist(), d0.tolist(), counts.tolist())) == joint_runs(src, dst)
        starts, counts = block_run_arrays(src)
        assert list(zip(starts.tolist(), counts.tolist())) == block_runs(src)
    empty = run_arrays([], [])
    assert all(a.size == 0 for a in empty)


NUM_BLOCKS, BLOCK_BYTES = 64, 48

# Block-id lists made of stretches: consecutive ids, reversed ids, repeats of one id, or jumps.
stretch = st.tuples(st.integers(0, NUM_BLOCKS - 1), st.integers(1, 9), st.sampled_from([1, -1, 0, 7]))


def stretched(parts: list[tuple[int, int, int]]) -> list[int]:
    return [(start + i * step) % NUM_BLOCKS for start, n, step in parts for i in range(n)]


def byte_order(offsets, lengths) -> list[int]:
    """Every byte address the spans cover, in order."""
    return [a for o, n in zip(offsets.tolist(), lengths.tolist()) for a in range(o, o + n)]


@settings(max_examples=200, deadline=None)
@given(st.lists(stretch, min_size=1, max_size=8), st.lists(stretch, min_size=1, max_size=8), st.integers(0, 3))
def test_coalesced_runs_move_the_same_bytes_in_the_same_order(src_parts, dst_parts, layer):
    src, dst = stretched(src_parts), stretched(dst_parts)
    n = min(len(src), len(dst))
    src, dst = src[:n], dst[:n]
    base = layer * 2 * NUM_BLOCKS * BLOCK_BYTES
    # Per block, K then V: what an uncoalesced transfer moves, and where it lands.
    src_k = [base + b * BLOCK_BYTES for b in src]
    dst_k = [base + b * BLOCK_BYTES for b in dst]
    v = NUM_BLOCKS * BLOCK_BYTES
    want = [(s + i, d + i) for s, d in zip(src_k + [a + v for a in src_k], dst_k + [a + v for a in dst_k])
            for i in range(BLOCK_BYTES)]

    s0, d0, counts = run_arrays(src, dst)         # one descriptor per joint run (NIXL)
    src_spans = layer_spans(s0, counts, base, NUM_BLOCKS, BLOCK_BYTES)
    dst_spans = layer_spans(d0, counts, base, NUM_BLOCKS, BLOCK_BYTES)
    assert list(zip(byte_order(*src_spans), byte_order(*dst_spans))) == want
    assert counts.sum() == n and (counts >= 1).all()

    for coalesce in (True, False):                # each side on its own (TCP's gather and scatter)
        got_src = byte_order(*layer_spans(*side_runs(src, coalesce), base, NUM_BLOCKS, BLOCK_BYTES))
        got_dst = byte_order(*layer_spans(*side_runs(dst, coalesce), base, NUM_BLOCKS, BLOCK_BYTES))
        assert list(zip(got_src, got_dst)) == want
    assert len(side_runs(src, True)[0]) <= len(s0) <= n


def test_run_length_histogram():
    _, _, counts = run_arrays([4, 5, 6, 9, 1, 2], [0, 1, 2, 3, 7, 8])
    assert counts.tolist() == [3, 1, 2]
    assert run_length_histogram(counts) == {1: 1, 2: 1, 3: 1}
    assert run_length_histogram([2, 2, 5]) == {2: 2, 5: 1}
    assert run_length_histogram([]) == {}


def test_block_ids_must_be_flat_integers():
    assert block_ids_array([3, 1, 2]).dtype == np.int64
    assert block_ids_array(range(4)).tolist() == [0, 1, 2, 3]
    assert block_ids_array(np.array([5], dtype=np.uint32)).tolist() == [5]
    for bad in ([1.5, 2.0], [[1, 2]], [True, False]):
        with pytest.raises(ValueError, match="integers"):
            block_ids_array(bad)


def test_huge_page_advice_covers_the_aligned_interior_only():
    big = empty_pool((4 * HUGE_PAGE + 123,), torch.uint8)
    advised = advise_huge_pages(big)
    assert advised % HUGE_PAGE == 0 and 3 * HUGE_PAGE <= advised <= 4 * HUGE_PAGE
    assert advise_huge_pages(torch.empty(1000, dtype=torch.uint8)) == 0
    big.fill_(7)                                         # advice changes nothing observable
    assert int(big.sum()) == 7 * big.numel()


def test_frame_advance_consumes_partial_views():
    views = [memoryview(b"abc"), memoryview(b""), memoryview(b"defg"), memoryview(b"hi")]
    frame = _Frame(1, list(views), None)
    frame.advance(2)
    assert bytes(frame.views[frame.index]) == b"c"
    frame.advance(1)                                      # skips the empty view too
    assert bytes(frame.views[frame.index]) == b"defg"
    frame.advance(5)
    assert bytes(frame.views[frame.index]) == b"i" and not frame.sent
    frame.advance(1)
    assert frame.sent


def test_a_batch_of_views_holds_what_is_ready_and_no_more():
    views = [memoryview(bytes(4))] * 5
    assert [_batch_end(views, 0, n) for n in (0, 1, 4, 5, 8, 9, 100)] == [1, 1, 1, 2, 2, 3, 5]
    assert _batch_end(views, 3, 100) == 5
    many = [memoryview(bytes(1))] * (IOV_MAX + 10)
    assert _batch_end(many, 5, 10 ** 9) == 5 + IOV_MAX


def test_scattered_views_round_trip_through_a_socket_with_small_buffers():
    """3000 runs (three IOV_MAX batches) sent with sendmsg and scattered with recvmsg_into."""
    rng = np.random.default_rng(0)
    source = rng.integers(0, 255, size=3000 * 64, dtype=np.uint8)
    order = rng.permutation(3000)
    lengths = rng.integers(1, 64, size=3000)
    src_views = [memoryview(source)[i * 64:i * 64 + n] for i, n in zip(order.tolist(), lengths.tolist())]
    expected = b"".join(bytes(v) for v in src_views)
    target = np.zeros(3000 * 64, dtype=np.uint8)
    dst_order = rng.permutation(3000)
    dst_views = [memoryview(target)[i * 64:i * 64 + n] for i, n in zip(dst_order.tolist(), lengths.tolist())]
    assert len(dst_views) > 2 * IOV_MAX

    a, b = socket.socketpair()
    for sock in (a, b):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    b.setblocking(False)

    def send():
        frame = _Frame(1, list(src_views), None)
        while not frame.sent:
            frame.advance(a.sendmsg(frame.views[frame.index:frame.index + IOV_MAX]))

    sender = threading.Thread(target=send)
    sender.start()
    asyncio.run(asyncio.wait_for(_recv_views(b, dst_views), 30))
    sender.join()
    got = b"".join(bytes(memoryview(target)[i * 64:i * 64 + n]) for i, n in zip(dst_order.tolist(),
                                                                               lengths.tolist()))
    assert got == expected
    a.close()
    b.close()
