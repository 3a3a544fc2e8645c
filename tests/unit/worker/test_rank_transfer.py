"""Per-rank transfer bookkeeping over real TCP connectors on loopback (one process).

A prefill group of two ranks (one KV head each) writes into a TP=1 decode pool:
rank 0 notifies only after the other rank reported its writes done, each rank's head
lands at its offset, a failure reported by the other rank fails the request, an
open send fails at its grant's deadline, a fence stops a send and answers once its
posted writes are no longer in flight, and nothing stays open afterwards.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from splitserve.kvtransfer import KVLayout, make_connector, transfer_digest
from splitserve.kvtransfer.errors import PeerLostError, ReservationExpiredError, TransferError, TransferTimeoutError
from splitserve.kvtransfer.sender_receiver import LayerReady
from splitserve.kvtransfer.rank_transfer import RankTransfer
from splitserve.kvtransfer.sender_receiver import TransferEndpoint, TransferGrant, TransferTarget
from splitserve.testing.waiting import wait_until

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


class _InFlight:
    """A posted write the test completes by hand (stands in for a slow RDMA write)."""

    def __init__(self):
        self.done = False
        self.error = None

    @property
    def finished(self) -> bool:
        return self.done or self.error is not None


def test_a_fence_stops_the_send_and_answers_once_its_writes_landed(group, monkeypatch):
    decode, (rank0, _) = group
    grant = decode.expect("f", [3, 4], ttl_s=10)
    target = _target(decode, [3, 4], grant.deadline_unix)
    rank0.begin("f", target, 8, notify=True)
    in_flight = []

    def slow_write(grant, layer, src, dst):
        in_flight.append(_InFlight())
        return in_flight[-1]

    polls_after_fence = threading.Semaphore(0)
    fence_asked = threading.Event()

    def poll(handle):
        if fence_asked.is_set():
            polls_after_fence.release()
        return handle.done

    monkeypatch.setattr(rank0.connector, "write_layer", slow_write)
    monkeypatch.setattr(rank0.connector, "poll", poll)
    rank0.on_layer_ready(LayerReady("f", 0, 0, [5, 6], 8))
    assert len(in_flight) == 1
    fenced = Outcome()
    fence_asked.set()
    rank0.fence("f", fenced)
    for _ in range(2):                                 # the driver looked at the write twice since
        assert polls_after_fence.acquire(timeout=10)
    assert not fenced.event.is_set()                   # a write is still in flight
    rank0.on_layer_ready(LayerReady("f", 1, 0, [5, 6], 8))
    assert len(in_flight) == 1                         # nothing posted after the fence
    in_flight[0].done = True
    assert fenced.wait() == (None, None)
    with pytest.raises(TransferError, match="fenced"):
        rank0.begin("f", target, 8, notify=True)       # a Prefill arriving after the fence
    unknown = Outcome()
    rank0.fence("never-sent", unknown)                 # e.g. the fence overtook its Prefill
    assert unknown.wait() == (None, None)
    with pytest.raises(TransferError, match="fenced"):
        rank0.begin("never-sent", target, 8, notify=True)
    decode.release("f")
    assert decode.num_open() == 0


def test_a_fence_over_a_timed_out_write_is_not_drained(group, monkeypatch):
    decode, (rank0, _) = group
    grant = decode.expect("t", [1], ttl_s=10)
    rank0.begin("t", _target(decode, [1], grant.deadline_unix), 3, notify=True)
    stuck = _InFlight()
    monkeypatch.setattr(rank0.connector, "write_layer", lambda *a: stuck)
    monkeypatch.setattr(rank0.connector, "poll", lambda handle: handle.done)
    rank0.on_layer_ready(LayerReady("t", 0, 0, [2], 3))
    fenced = Outcome()
    rank0.fence("t", fenced)
    stuck.error = TransferTimeoutError("t: write did not complete")   # what poll sets past the timeout
    _, error = fenced.wait()
    assert isinstance(error, TransferTimeoutError)     # it may still land: not drained
    decode.release("t")


def test_a_receiver_on_every_interface_is_written_at_the_address_it_advertises():
    """A pod's worker listens on 0.0.0.0 (--host) and tells peers its pod IP (--advertise-host):
    the metadata a prefill worker fetches names that address, and a whole transfer goes there."""
    layout = LAYOUT.with_tp(0, 1)
    connector = make_connector("tcp", "decode-pod", layout, host="0.0.0.0", advertise_host="127.0.0.1")
    connector.register(torch.zeros(layout.pool_shape(NUM_BLOCKS)))
    decode = RankTransfer(connector, LAYOUT.block_size)
    prefill = _rank("prefill-pod", 0, 1, seed=3)
    plain = make_connector("tcp", "plain", layout, host="0.0.0.0")
    try:
        assert decode.metadata.address.startswith("127.0.0.1:")
        assert plain.address.startswith("0.0.0.0:")                 # without one: the bound address
        grant = decode.expect("r", [3, 4], ttl_s=10)
        prefill.begin("r", _target(decode, [3, 4], grant.deadline_unix), 8, notify=True)
        _prefill([prefill], "r", [5, 6], 8)
        sent = Outcome()
        prefill.close_send("r", b"first-token", sent)
        assert sent.wait() == (None, None)
        received = Outcome()
        decode.watch("r", received)
        assert received.wait() == (b"first-token", None)
        for layer in range(LAYOUT.num_layers):
            assert torch.equal(decode.connector.pool[layer][:, [3, 4]], prefill.connector.pool[layer][:, [5, 6]])
        decode.release("r")
    finally:
        plain.close()
        decode.close()
        prefill.close()


def _single_ranks(layout_name: str):
    layout = KVLayout(model="m", dtype="float32", num_layers=3, num_kv_heads=2, head_dim=4, block_size=4,
                      layout=layout_name)
    pair = []
    for name, seed in (("decode-d", 0), ("prefill-d", 1)):
        connector = make_connector("tcp", name, layout)
        connector.register(torch.randn(layout.pool_shape(NUM_BLOCKS), generator=torch.Generator().manual_seed(seed)))
        pair.append(RankTransfer(connector, layout.block_size))
    return pair


def _send_and_receive(decode: RankTransfer, prefill: RankTransfer, request_id: str, dst: list[int]) -> tuple:
    grant = decode.expect(request_id, dst, ttl_s=10)
    prefill.begin(request_id, _target(decode, dst, grant.deadline_unix), 8, notify=True)
    for layer in range(prefill.connector.layout.num_layers):
        prefill.on_layer_ready(LayerReady(request_id, layer, 0, [5, 6], 8))
    sent = Outcome()
    prefill.close_send(request_id, b"first-token", sent)
    assert sent.wait() == (None, None)
    received = Outcome()
    decode.watch(request_id, received)
    outcome = received.wait()
    decode.release(request_id)
    return outcome


@pytest.mark.parametrize("layout_name", ["layer-major-v1", "paged-heads-kv-v1"])
def test_the_receiver_takes_the_kv_only_when_it_matches_the_senders_digest(layout_name, tmp_path, monkeypatch):
    """transfer_digest.py: a transfer whose middle layer was dropped or sent from the wrong blocks
    (the fault-injection file) is refused with a TransferError, never handed on as done."""
    fault_file = tmp_path / "kv-fault"
    monkeypatch.setenv("SPLITSERVE_KV_FAULT_FILE", str(fault_file))
    decode, prefill = _single_ranks(layout_name)
    try:
        assert _send_and_receive(decode, prefill, "clean", [3, 4]) == (b"first-token", None)
        for fault, dst in (("drop", [0, 1]), ("corrupt", [2, 7])):       # blocks no earlier write filled
            fault_file.write_text(fault)
            payload, error = _send_and_receive(decode, prefill, f"faulty-{fault}", dst)
            assert payload is None and isinstance(error, TransferError) and "differs" in str(error), error
        fault_file.unlink()
        assert _send_and_receive(decode, prefill, "clean-again", [0, 1]) == (b"first-token", None)
        assert decode.connector.metric("digest_mismatches")._value.get() >= 2
        assert decode.num_open() == 0
    finally:
        decode.close()
        prefill.close()


def test_a_receiver_from_before_the_stream_digest_gets_the_envelope_it_checks(monkeypatch):
    """A rolling update: a receiver whose metadata names no `digest-stream` feature is sent the
    CRC-32 envelope (KVd1) that every earlier receiver checks; a current one the xxh3 stream (KVd3)."""
    decode, prefill = _single_ranks("layer-major-v1")
    envelopes = []
    poll = decode.connector.poll_notification

    def recording(request_id):
        payload = poll(request_id)
        if payload is not None:
            envelopes.append(payload[:4])
        return payload
    monkeypatch.setattr(decode.connector, "poll_notification", recording)
    try:
        assert _send_and_receive(decode, prefill, "current", [3, 4]) == (b"first-token", None)
        decode.metadata = dataclasses.replace(decode.metadata, features=())
        prefill.connector.remove_peer(decode.metadata.name)
        assert _send_and_receive(decode, prefill, "earlier", [0, 1]) == (b"first-token", None)
        assert envelopes == [transfer_digest.STREAM, transfer_digest.CRC32]
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("layout_name", ["layer-major-v1", "paged-heads-kv-v1"])
def test_the_receiver_checks_each_layer_as_it_lands_and_only_the_rest_at_the_end(layout_name, monkeypatch, tmp_path):
    """transfer_digest.py: the sender announces each layer once its writes are done; the receiver
    hashes it then, while later layers fly, and the completion's check hashes no layer twice.
    A layer that landed damaged (the fault switch: its writes taken from other blocks) is named."""
    fault_file = tmp_path / "kv-fault"
    monkeypatch.setenv("SPLITSERVE_KV_FAULT_FILE", str(fault_file))
    decode, prefill = _single_ranks(layout_name)
    hashed: list[tuple[str, int]] = []
    real = transfer_digest.held_layer_digest

    def counting(pool, layout, blocks, layer):
        hashed.append((threading.current_thread().name, layer))
        return real(pool, layout, blocks, layer)
    monkeypatch.setattr(transfer_digest, "held_layer_digest", counting)
    notes = decode.connector.metric("transfers", "recv", "progress")     # a process-wide counter
    layers, before = prefill.connector.layout.num_layers, notes._value.get()
    try:
        grant = decode.expect("r", [3, 4], ttl_s=10)
        prefill.begin("r", _target(decode, [3, 4], grant.deadline_unix), 8, notify=True)
        received = Outcome()
        decode.watch("r", received)
        for layer in range(layers):
            prefill.on_layer_ready(LayerReady("r", layer, 0, [5, 6], 8))
        wait_until(lambda: notes._value.get() == before + layers and len(hashed) == layers, timeout=10,
                   what="the receiver to check every announced layer", details=lambda: (notes._value.get(), hashed))
        assert sorted(layer for _, layer in hashed) == list(range(layers))     # before the completion
        prefill.close_send("r", b"first-token", Outcome())
        assert received.wait() == (b"first-token", None)
        assert len(hashed) == layers and all(name.startswith("kv-digest") for name, _ in hashed)
        decode.release("r")

        fault_file.write_text("corrupt")                # the middle layer's writes from other blocks
        assert _send_and_receive(decode, prefill, "damaged", [0, 1]) == (None, _Matching("layers [1] differ"))
    finally:
        decode.close()
        prefill.close()


class _Matching:
    """Equal to a TransferError whose message contains `text`."""

    def __init__(self, text: str):
        self.text = text

    def __eq__(self, other) -> bool:
        return isinstance(other, TransferError) and self.text in str(other)

    def __repr__(self) -> str:
        return f"TransferError(...{self.text}...)"
