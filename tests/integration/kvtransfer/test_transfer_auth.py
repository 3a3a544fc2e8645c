"""The deployment's transfer token, on both backends, between real processes.

- Same token on both sides: metadata is accepted and the bytes arrive.
- A receiver whose metadata carries no (or another) token's tag: the sender's
  `add_peer` refuses it with PeerAuthError before loading anything, counted as
  reason "unauthenticated".
- A sender without the token that skips that check (it has no token, so it
  accepts any metadata) still gets nowhere: TCP — the receiver's challenge at
  connect refuses it before any frame is read, nothing is written, and the
  sender's write fails with PeerAuthError; NIXL — one-sided writes cannot be
  vetoed, but the receiver refuses the completion notification (no tag), so the
  request's KV is never accepted and its reservation ends by its deadline.
- Matching layout hashes are still required after the token (a token does not
  override a layout mismatch).
"""

from __future__ import annotations

import pytest

from splitserve.kvtransfer.errors import LayoutMismatchError, PeerAuthError, ReservationExpiredError
from splitserve.kvtransfer.peer import layout_dict

from .conftest import NUM_BLOCKS, TIMEOUT_S

TOKEN = b"deployment-secret-1"
OTHER = b"some-other-deployment"
FAILURES = "splitserve_kv_transfer_failures_total"


def _start(peers, name, layout, seed, token):
    peer = peers.start_raw()
    meta = peer.call("setup", peers.backend, name, layout_dict(layout), NUM_BLOCKS, seed, TIMEOUT_S, token=token)
    return peer, meta


def _failures(peer, backend) -> float:
    return peer.call("metric", FAILURES, {"backend": backend, "reason": "unauthenticated"}) or 0.0


def test_same_token_transfers(fresh_peers, layout_for, assert_written):
    layout = layout_for()
    sender, _ = _start(fresh_peers, "prefill-0", layout, 1, TOKEN)
    receiver, rmeta = _start(fresh_peers, "decode-0", layout, None, TOKEN)
    sender.call("add_peer", rmeta)
    reservation = receiver.call("reserve", "r1", [3, 4], 30.0)
    sender.call("send_request", reservation, [0, 1], [3, 4], b"first")
    assert receiver.call("wait_notification", "r1", 10.0) == b"first"
    assert_written(sender.call("pool"), receiver.call("pool"), [0, 1], [3, 4])
    assert receiver.call("active_reservations") == {}


def test_metadata_without_the_token_is_refused(fresh_peers, layout_for, backend):
    layout = layout_for()
    sender, _ = _start(fresh_peers, "prefill-0", layout, 1, TOKEN)
    _, untokened = _start(fresh_peers, "decode-0", layout, None, b"")
    _, other = _start(fresh_peers, "decode-1", layout, None, OTHER)
    for meta in (untokened, other):
        with pytest.raises(PeerAuthError, match="transfer token"):
            sender.call("add_peer", meta)
    assert sender.call("peer", "decode-0") is None and sender.call("peer", "decode-1") is None
    assert _failures(sender, backend) == 2
    # The token does not replace the layout check: same token, different layout, still refused.
    _, mismatched = _start(fresh_peers, "decode-2", layout_for(block_size=16), None, TOKEN)
    with pytest.raises(LayoutMismatchError, match="block_size"):
        sender.call("add_peer", mismatched)


def test_sender_without_the_token_gets_nothing_accepted(fresh_peers, layout_for, backend):
    layout = layout_for()
    intruder, _ = _start(fresh_peers, "intruder", layout, 1, b"")
    receiver, rmeta = _start(fresh_peers, "decode-0", layout, None, TOKEN)
    intruder.call("add_peer", rmeta)              # no token of its own: it checks nothing
    receiver.call("fill", 0.0)
    reservation = receiver.call("reserve", "r2", [5, 6], 1.0)
    if backend == "tcp":
        with pytest.raises(PeerAuthError, match="refused the connection"):
            intruder.call("send_request", reservation, [0, 1], [5, 6], b"evil")
        assert not receiver.call("pool").any(), "an unauthenticated sender wrote into the receiver"
        receiver.call("release", "r2")
    else:
        intruder.call("send_request", reservation, [0, 1], [5, 6], b"evil")
        with pytest.raises(ReservationExpiredError):
            receiver.call("wait_notification", "r2", 10.0)
    assert receiver.call("active_reservations") == {}
    assert _failures(receiver, backend) >= 1
