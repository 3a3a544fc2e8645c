"""Pure pieces of the fast paths: vectorised run coalescing, block-id validation, huge-page
advice, and the TCP backend's gather (sendmsg) / scatter (recvmsg_into) helpers."""

from __future__ import annotations

import asyncio
import random
import socket
import threading

import numpy as np
import pytest
import torch

from splitserve.kvtransfer.connector import block_ids_array
from splitserve.kvtransfer.memory import HUGE_PAGE, advise_huge_pages, empty_pool
from splitserve.kvtransfer.tcp import IOV_MAX, _Frame, _recv_views
from splitserve.kvtransfer.tp_slicing import block_run_arrays, block_runs, joint_runs, run_arrays


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
