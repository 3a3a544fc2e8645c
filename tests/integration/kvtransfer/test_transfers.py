"""Byte-exact transfers between two real processes, on both backends.

Block patterns come from hypothesis (scattered, contiguous, single block, whole
pool) in fp32, bf16 and fp16; then many concurrent requests between the same
two peers, one receiver fed by two senders, and the metrics they leave behind.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torch

NUM_BLOCKS = 48                      # conftest.NUM_BLOCKS

_ids = itertools.count()


@st.composite
def block_patterns(draw):
    kind = draw(st.sampled_from(["scattered", "contiguous", "single", "whole"]))
    if kind == "whole":
        src = list(range(NUM_BLOCKS))
        dst = draw(st.sampled_from([list(range(NUM_BLOCKS)), list(reversed(range(NUM_BLOCKS)))]))
        return src, dst
    if kind == "single":
        return [draw(st.integers(0, NUM_BLOCKS - 1))], [draw(st.integers(0, NUM_BLOCKS - 1))]
    n = draw(st.integers(2, NUM_BLOCKS // 2))
    if kind == "contiguous":
        s0, d0 = draw(st.integers(0, NUM_BLOCKS - n)), draw(st.integers(0, NUM_BLOCKS - n))
        return list(range(s0, s0 + n)), list(range(d0, d0 + n))
    src = draw(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=n, max_size=n))
    dst = draw(st.permutations(range(NUM_BLOCKS)))[:n]
    return src, dst


def _transfer(sender, receiver, src, dst, payload=b"first-token"):
    rid = f"req-{next(_ids)}"
    receiver.call("fill", 0.0)
    reservation = receiver.call("reserve", rid, dst, 30.0)
    sender.call("send_request", reservation, src, dst, payload)
    assert receiver.call("wait_notification", rid, 10.0) == payload
    assert receiver.call("active_reservations") == {}


@pytest.fixture(scope="module", params=["float32", "bfloat16", "float16"])
def typed_pair(request, peers, layout_for):
    layout = layout_for(request.param)
    sender, _ = peers.start(f"prefill-{request.param}", layout, seed=7)
    receiver, rmeta = peers.start(f"decode-{request.param}", layout, seed=None)
    sender.call("add_peer", rmeta)
    return sender, receiver, sender.call("pool")


def test_block_patterns_are_byte_exact(typed_pair, assert_written):
    sender, receiver, src_pool = typed_pair

    @settings(max_examples=12, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(block_patterns())
    def check(pattern):
        src, dst = pattern
        _transfer(sender, receiver, src, dst)
        assert_written(src_pool, receiver.call("pool"), src, dst)

    check()


def test_many_concurrent_requests_between_two_peers(pair, assert_written):
    sender, receiver, _, _ = pair
    receiver.call("fill", 0.0)
    requests, expected_src, expected_dst = [], [], []
    for i in range(12):                                   # 12 requests × 4 blocks, interleaved layer by layer
        src, dst = [i, 47 - i, 20 + i, 3 * i], [4 * i + k for k in range(4)]
        rid = f"conc-{next(_ids)}"
        reservation = receiver.call("reserve", rid, dst, 30.0)
        requests.append((reservation, src, dst, f"tok{i}".encode()))
        expected_src += src
        expected_dst += dst
    sender.call("send_many", requests)
    for reservation, _, _, payload in requests:
        assert receiver.call("wait_notification", reservation.request_id, 10.0) == payload
    assert_written(sender.call("pool"), receiver.call("pool"), expected_src, expected_dst)
    assert receiver.call("active_reservations") == {}


def test_one_receiver_two_senders(pair, peers, layout_for):
    sender, receiver, _, rmeta = pair
    second, _ = peers.start("prefill-1", layout_for(), seed=2)
    second.call("add_peer", rmeta)
    receiver.call("fill", 0.0)
    r1 = receiver.call("reserve", "two-a", [0, 1, 2, 3], 30.0)
    r2 = receiver.call("reserve", "two-b", [10, 12, 14], 30.0)
    sender.send("send_request", r1, [5, 6, 7, 8], [0, 1, 2, 3], b"a")
    second.send("send_request", r2, [1, 2, 3], [10, 12, 14], b"b")
    sender.result()
    second.result()
    assert receiver.call("wait_notification", "two-a", 10.0) == b"a"
    assert receiver.call("wait_notification", "two-b", 10.0) == b"b"
    got = receiver.call("pool")
    assert torch.equal(got[:, :, [0, 1, 2, 3]], sender.call("pool")[:, :, [5, 6, 7, 8]])
    assert torch.equal(got[:, :, [10, 12, 14]], second.call("pool")[:, :, [1, 2, 3]])
    assert not got[:, :, [4, 5, 6, 7, 8, 9, 11, 13, 15]].any()
    assert receiver.call("active_reservations") == {}


def test_metrics_count_bytes_transfers_and_latency(pair, backend, layout_for):
    sender, receiver, _, _ = pair
    labels = {"backend": backend, "direction": "send"}
    before = sender.call("metric", "splitserve_kv_transfer_bytes_total", labels) or 0.0
    writes_before = sender.call("metric", "splitserve_kv_transfers_total", {**labels, "kind": "write"}) or 0.0
    _transfer(sender, receiver, [1, 2], [30, 31])
    layout = layout_for()
    expected = layout.num_layers * 2 * 2 * layout.block_bytes + len(b"first-token")
    assert sender.call("metric", "splitserve_kv_transfer_bytes_total", labels) - before == expected
    assert sender.call("metric", "splitserve_kv_transfers_total", {**labels, "kind": "write"}) \
        - writes_before == layout.num_layers
    assert sender.call("metric", "splitserve_kv_transfer_seconds_count", {"backend": backend}) >= layout.num_layers
