"""Per-rank transfer bookkeeping over real TCP connectors on loopback (one process).

A prefill group of two ranks (one KV head each) writes into a TP=1 decode pool:
rank 0 notifies only after the other rank reported its writes done, each rank's head
lands at its offset, a failure reported by the other rank fails the request, an
open send fails at its grant's deadline, and nothing stays open afterwards.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from splitserve.kvtransfer import KVLayout, make_connector
from splitserve.kvtransfer.errors import PeerLostError, ReservationExpiredError
from splitserve.services.engine.sequence import LayerReady
from splitserve.services.worker.rank_transfer import RankTransfer
from splitserve.services.worker.transfer import TransferEndpoint, TransferGrant, TransferTarget

LAYOUT = KVLayout(model="m", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)
NUM_BLOCKS = 8


class Outcome:
    """A `Done` callback that can be waited for."""

    def __init__(self):
        self.event = threading.Event()
        self.value: tuple = ()

    def __call__(self, payload, error) -> None:
        self.value = (payload, error)
        self.event.set()

    def wait(self) -> tuple:
        assert self.event.wait(10), "the transfer never ended"
        return self.value


def _rank(name: str, tp_rank: int, tp_size: int, seed: int) -> RankTransfer:
    layout = LAYOUT.with_tp(tp_rank, tp_size)
    connector = make_connector("tcp", name, layout)
    connector.register(torch.randn(layout.pool_shape(NUM_BLOCKS), generator=torch.Generator().manual_seed(seed)))
    return RankTransfer(connector, LAYOUT.block_size)


@pytest.fixture
def group():
    decode = _rank("decode", 0, 1, seed=0)
    prefill = [_rank("prefill", 0, 2, seed=1), _rank("prefill-tp1", 1, 2, seed=2)]
    try:
        yield decode, prefill
    finally:
        for t in [decode, *prefill]:
            t.close()


def _target(decode: RankTransfer, block_ids: list[int], deadline_unix: float) -> TransferTarget:
    m = decode.metadata
    return TransferTarget(TransferEndpoint(m.name, m.to_bytes(), m.layout_hash.encode(), m.incarnation),
                          block_ids, 0, TransferGrant(m.incarnation, deadline_unix))


def _prefill(prefill: list[RankTransfer], request_id: str, src: list[int], num_tokens: int) -> None:
    for layer in range(LAYOUT.num_layers):
        for rank in prefill:
            rank.on_layer_ready(LayerReady(request_id, layer, 0, src, num_tokens))


def test_rank0_notifies_after_every_rank_wrote_its_heads(group):
    decode, (rank0, rank1) = group
    grant = decode.expect("r", [3, 4], ttl_s=10)
    target = _target(decode, [3, 4], grant.deadline_unix)
    rank0.begin("r", target, 8, notify=True, pending_ranks={1})
    child = Outcome()
    rank1.begin("r", target, 8, notify=False, on_done=child)
    _prefill([rank0, rank1], "r", [5, 6], 8)
    first = Outcome()
    rank0.close_send("r", b"first-token", first)
    assert child.wait() == (None, None)            # rank 1's writes are done: it reports
    assert not first.event.is_set() and decode.num_open() == 1   # rank 0 has not notified yet
    rank0.rank_reported("r", 1, None)
    assert first.wait() == (None, None)
    received = Outcome()
    decode.watch("r", received)
    assert received.wait() == (b"first-token", None)
    pool = decode.connector.pool
    for layer in range(LAYOUT.num_layers):
        for src_rank, head in ((rank0, 0), (rank1, 1)):     # each rank's head at its offset
            assert torch.equal(pool[layer][:, [3, 4], :, head], src_rank.connector.pool[layer][:, [5, 6], :, 0])
    decode.release("r")
    assert decode.num_open() == 0


def test_a_failure_on_another_rank_fails_the_request(group):
    decode, (rank0, _) = group
    grant = decode.expect("q", [1], ttl_s=10)
    rank0.begin("q", _target(decode, [1], grant.deadline_unix), 3, notify=True, pending_ranks={1})
    _prefill([rank0], "q", [2], 3)
    rank0.rank_reported("q", 1, PeerLostError("rank 1 lost its peer"))
    outcome = Outcome()
    rank0.close_send("q", b"", outcome)
    assert isinstance(outcome.wait()[1], PeerLostError)
    assert decode.num_open() == 1                  # never notified: the owner releases it
    decode.release("q")
    assert decode.num_open() == 0


def test_an_open_send_fails_at_its_grant_deadline(group):
    decode, (_, rank1) = group
    decode.expect("late", [2], ttl_s=10)
    outcome = Outcome()
    rank1.begin("late", _target(decode, [2], time.time() + 0.2), 3, notify=False, on_done=outcome)
    assert isinstance(outcome.wait()[1], ReservationExpiredError)    # no layer ever came
    rank1.abandon("late")                          # idempotent after the failure
    decode.release("late")
    assert decode.num_open() == 0
