"""Faults: SIGKILL one side mid-transfer; the survivor errors within its timeout and leaks nothing.

A restarted peer is a new incarnation: grants of the dead one are refused
(never written with stale metadata), and after a new handshake transfers work.
"""

from __future__ import annotations

import time

import pytest
import torch

from splitserve.kvtransfer.errors import StalePeerError, TransferError

TIMEOUT_S = 3.0            # conftest.TIMEOUT_S, the connectors' configured timeout
SLACK_S = 4.0              # process scheduling on 2 busy cores
BLOCKS = list(range(16))


def _start_streaming(sender, reservation):
    sender.send("write_loop", reservation, BLOCKS, BLOCKS, 30.0)
    kind, _ = sender.next_event(30)
    assert kind == "progress"


def test_receiver_killed_mid_transfer_then_restarted(fresh_peers, layout_for):
    layout = layout_for()
    sender, _ = fresh_peers.start("prefill-f1", layout, seed=3)
    receiver, rmeta = fresh_peers.start("decode-f1", layout, seed=None)
    sender.call("add_peer", rmeta)
    old = receiver.call("reserve", "victim", BLOCKS, 60.0)
    _start_streaming(sender, old)

    receiver.kill()
    killed_at = time.monotonic()
    with pytest.raises(TransferError):
        sender.result(timeout_s=TIMEOUT_S + SLACK_S + 30)
    assert time.monotonic() - killed_at < TIMEOUT_S + SLACK_S

    restarted, new_meta = fresh_peers.start("decode-f1", layout, seed=None)
    assert new_meta.incarnation != rmeta.incarnation
    sender.call("add_peer", new_meta)
    with pytest.raises(StalePeerError, match="incarnation"):
        sender.call("send_request", old, [0], [0])
    reservation = restarted.call("reserve", "after-restart", [1, 2, 3], 30.0)
    sender.call("send_request", reservation, [4, 5, 6], [1, 2, 3], b"ok")
    assert restarted.call("wait_notification", "after-restart", 10.0) == b"ok"
    got, src = restarted.call("pool"), sender.call("pool")
    assert torch.equal(got[:, :, [1, 2, 3]], src[:, :, [4, 5, 6]])
    assert restarted.call("active_reservations") == {}


def test_sender_killed_mid_transfer_frees_the_reservation(fresh_peers, layout_for):
    layout = layout_for()
    sender, _ = fresh_peers.start("prefill-f2", layout, seed=3)
    receiver, rmeta = fresh_peers.start("decode-f2", layout, seed=None)
    sender.call("add_peer", rmeta)
    reservation = receiver.call("reserve", "orphan", BLOCKS, 60.0)
    _start_streaming(sender, reservation)

    sender.kill()
    killed_at = time.monotonic()
    with pytest.raises(TransferError):
        receiver.call("wait_notification", "orphan", TIMEOUT_S)
    assert time.monotonic() - killed_at < TIMEOUT_S + SLACK_S
    assert receiver.call("active_reservations") == {}

    replacement, _ = fresh_peers.start("prefill-f2", layout, seed=4)
    replacement.call("add_peer", rmeta)
    again = receiver.call("reserve", "orphan-retry", BLOCKS, 30.0)
    replacement.call("send_request", again, BLOCKS, BLOCKS, b"ok")
    assert receiver.call("wait_notification", "orphan-retry", 10.0) == b"ok"
    assert torch.equal(receiver.call("pool")[:, :, BLOCKS], replacement.call("pool")[:, :, BLOCKS])
