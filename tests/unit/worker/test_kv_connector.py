"""The connector adapter's bookkeeping, without a network: which blocks each layer report
sends, the first-token payload, the backend choice, and the leak-free end of a request."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from splitserve.kvtransfer import AgentMetadata, KVLayout, TransferError
from splitserve.services.engine.sampler import SampledToken
from splitserve.kvtransfer.sender_receiver import LayerReady
from splitserve.services.worker.output_messages import decode_first_token, encode_first_token
from splitserve.kvtransfer.rank_transfer import SingleRankTransfer
from splitserve.kvtransfer.backends import resolve_backend
from splitserve.kvtransfer.sender_receiver import TransferEndpoint, TransferGrant, TransferTarget

LAYOUT = KVLayout(model="m", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=4, block_size=16)


class _Handle:
    done = True
    error = None
    finished = True
    layer = 0
    counted = True
    done_at = 0.0            # no completion time: no timing is observed


class FakeConnector:
    """Records what the adapter posts; every write and notification completes at once."""

    backend = "tcp"
    name = "fake"
    pool = None              # no KV memory: its sends carry no digest (transfer_digest.py)

    def __init__(self):
        self.layout = LAYOUT
        self.writes: list[tuple[int, list[int], list[int]]] = []
        self.notified: list[bytes] = []
        self.forgotten: list[str] = []
        self.peers: dict[str, AgentMetadata] = {}

    def metadata(self) -> AgentMetadata:
        return AgentMetadata("fake", "inc-1", "tcp", "127.0.0.1:1", LAYOUT, LAYOUT.layout_hash(), 64,
                             (0, 0), "cpu")

    def peer(self, name):
        return self.peers.get(name)

    def add_peer(self, meta):
        self.peers[meta.name] = meta

    def write_layer(self, grant, layer, src, dst):
        assert set(dst) <= set(grant.block_ids)
        self.writes.append((layer, list(src), list(dst)))
        return _Handle()

    def notify(self, grant, payload):
        self.notified.append(payload)
        return _Handle()

    def poll(self, handle):
        return True

    def progress(self):
        pass

    def forget_request(self, request_id):
        self.forgotten.append(request_id)

    def close(self):
        pass


def _target(meta: AgentMetadata, block_ids: list[int], num_cached: int) -> TransferTarget:
    return TransferTarget(TransferEndpoint(meta.name, meta.to_bytes(), meta.layout_hash.encode(), meta.incarnation),
                          block_ids, num_cached, TransferGrant(meta.incarnation, 1e12))


def test_each_block_is_sent_once_per_layer_and_cached_blocks_never():
    connector = FakeConnector()
    transfer = SingleRankTransfer(connector, block_size=16)
    receiver_meta = AgentMetadata("decode", "inc-9", "tcp", "127.0.0.1:2", LAYOUT, LAYOUT.layout_hash(), 64,
                                  (0, 0), "cpu")
    try:
        # 40 tokens = 3 blocks; the decode side holds block 0; prefilled in two 20-token chunks.
        transfer.begin("r", _target(receiver_meta, [50, 51, 52], 1), 40)
        for layer in range(2):
            transfer.on_layer_ready(LayerReady("r", layer, 0, [10, 11], 20))   # block 1 is still partial
        assert connector.writes == []
        for layer in range(2):
            transfer.on_layer_ready(LayerReady("r", layer, 1, [11, 12], 40))   # final chunk
        assert connector.writes == [(0, [11, 12], [51, 52]), (1, [11, 12], [51, 52])]
        payload = encode_first_token(SampledToken(7, -0.5, {7: -0.5, 3: -1.5}))
        asyncio.run(transfer.finish("r", payload))
        assert connector.notified == [payload]
        assert decode_first_token(payload) == SampledToken(7, -0.5, {7: -0.5, 3: -1.5})
        assert decode_first_token(encode_first_token(SampledToken(9))) == SampledToken(9)
        transfer.abandon("r")
        assert connector.forgotten == ["r"]
    finally:
        transfer.close()


def test_a_missing_layer_fails_finish():
    connector = FakeConnector()
    transfer = SingleRankTransfer(connector, block_size=16)
    meta = AgentMetadata("decode", "inc-9", "tcp", "127.0.0.1:2", LAYOUT, LAYOUT.layout_hash(), 64, (0, 0), "cpu")
    try:
        transfer.begin("r", _target(meta, [5], 0), 10)
        transfer.on_layer_ready(LayerReady("r", 0, 0, [1], 10))
        with pytest.raises(TransferError, match="every layer"):
            asyncio.run(transfer.finish("r", b""))
        with pytest.raises(TransferError, match="destination blocks"):
            transfer.begin("q", _target(meta, [5, 6], 0), 10)
    finally:
        transfer.close()


def test_resolve_backend(monkeypatch):
    assert resolve_backend("tcp") == "tcp"
    assert resolve_backend("nixl") == "nixl"
    assert resolve_backend("auto") == "nixl"        # the nixl wheel is a dependency
    with pytest.raises(ValueError):
        resolve_backend("rdma")
    # A machine without the wheel (stood in for by hiding it from find_spec) falls back to TCP.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("nixl") else real_find_spec(name, *a))
    assert resolve_backend("auto") == "tcp"
