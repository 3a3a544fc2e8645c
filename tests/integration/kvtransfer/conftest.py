"""Two-process fixtures for the KV transfer suite; every test runs on both backends.

Peers are child processes (`splitserve.kvtransfer.peer.PeerProcess`) holding one
connector each. Pairs are reused within a module (starting a NIXL/UCX peer costs
2-4 s on 2 cores); tests reset the receiver's pool and end with a leak check
(no open reservations). NIXL must be installed: a missing backend fails, it
never skips.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from splitserve.kvtransfer.layout import KVLayout
from splitserve.kvtransfer.peer import PeerProcess, layout_dict

BACKENDS = ["tcp", "nixl"]
NUM_BLOCKS = 48
TIMEOUT_S = 3.0


def small_layout(dtype: str = "float32", **changes) -> KVLayout:
    values = dict(model="test-model", dtype=dtype, num_layers=3, num_kv_heads=4, head_dim=16, block_size=8)
    values.update(changes)
    return KVLayout(**values)


class Peers:
    """Starts peers and closes them all at the end."""

    def __init__(self, backend: str):
        self.backend = backend
        self.started: list[PeerProcess] = []

    def start(self, name: str, layout: KVLayout, seed: int | None, num_blocks: int = NUM_BLOCKS,
              timeout_s: float = TIMEOUT_S):
        peer = PeerProcess(call_timeout_s=60)
        self.started.append(peer)
        meta = peer.call("setup", self.backend, name, layout_dict(layout), num_blocks, seed, timeout_s)
        return peer, meta

    def start_raw(self) -> PeerProcess:
        """A peer process without setup (the caller chooses setup's arguments)."""
        peer = PeerProcess(call_timeout_s=60)
        self.started.append(peer)
        return peer

    def close(self) -> None:
        for peer in self.started:
            with contextlib.suppress(Exception):
                peer.close()


@pytest.fixture(params=BACKENDS, scope="module")
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def peers(backend):
    group = Peers(backend)
    yield group
    group.close()


@pytest.fixture
def fresh_peers(backend):
    group = Peers(backend)
    yield group
    group.close()


@pytest.fixture(scope="module")
def pair(peers):
    """(sender, receiver, sender_meta, receiver_meta) with fp32 pools; receiver zeroed."""
    layout = small_layout()
    sender, smeta = peers.start("prefill-0", layout, seed=1)
    receiver, rmeta = peers.start("decode-0", layout, seed=None)
    sender.call("add_peer", rmeta)
    return sender, receiver, smeta, rmeta


def _assert_written(src_pool: torch.Tensor, dst_pool: torch.Tensor, src: list[int], dst: list[int]) -> None:
    """dst blocks hold the src blocks' bytes exactly; every other receiver block is still zero."""
    assert torch.equal(dst_pool[:, :, dst].view(torch.uint8), src_pool[:, :, src].view(torch.uint8))
    untouched = sorted(set(range(dst_pool.shape[2])) - set(dst))
    assert not dst_pool[:, :, untouched].view(torch.uint8).any()


@pytest.fixture(scope="session")
def assert_written():
    return _assert_written


@pytest.fixture(scope="session")
def layout_for():
    return small_layout
