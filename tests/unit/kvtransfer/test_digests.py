"""The checksums of KV that moves (issue 41): the transfer digest's two envelopes and the block frame."""

from __future__ import annotations

import pytest
import torch

from splitserve.kvtransfer import KVLayout
from splitserve.kvtransfer import block_codec, transfer_digest

LAYOUT = KVLayout(model="m", dtype="float32", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)


@pytest.fixture
def pool() -> torch.Tensor:
    return torch.randn(LAYOUT.pool_shape(6), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("algorithm", [transfer_digest.XXH3, transfer_digest.CRC32])
def test_the_envelope_names_its_hash_and_the_receiver_recomputes_it(pool, algorithm):
    blocks = [1, 4]
    total = 0
    for layer in range(LAYOUT.num_layers):
        total = transfer_digest.add(total, transfer_digest.digest(pool, LAYOUT, layer, blocks, blocks, algorithm))
    sealed = transfer_digest.seal(b"payload", total, LAYOUT.num_layers * len(blocks), algorithm)
    sent, inner = transfer_digest.unseal(sealed)
    assert inner == b"payload" and sent[2] == algorithm
    assert transfer_digest.granted_digest(pool, LAYOUT, blocks, sent[2]) == sent[:2]
    pool[1, 0, 4, 2, 1, 3] += 1.0                        # one value of one layer of one block
    assert transfer_digest.granted_digest(pool, LAYOUT, blocks, sent[2]) != sent[:2]
    assert transfer_digest.unseal(b"no envelope") == (None, b"no envelope")


def test_the_digest_is_keyed_by_layer_and_destination_block(pool):
    same_bytes = transfer_digest.block_hash(pool, LAYOUT, 0, 2, dst_block=2)
    assert transfer_digest.block_hash(pool, LAYOUT, 0, 2, dst_block=3) != same_bytes      # landed elsewhere
    assert transfer_digest.block_hash(pool, LAYOUT, 1, 2, dst_block=2) != same_bytes


def test_a_block_frame_refuses_any_flipped_bit_of_its_payload():
    payload = bytes(range(256)) * 16
    layout = block_codec.layout_key("m|float32|4")
    framed = block_codec.encode_header(layout, payload) + payload
    assert bytes(block_codec.decode(framed, layout, len(payload))) == payload
    for position in (0, len(payload) // 3, len(payload) - 1):
        damaged = bytearray(framed)
        damaged[block_codec.HEADER.size + position] ^= 0x01
        with pytest.raises(block_codec.BlockRejected, match="corrupt"):
            block_codec.decode(damaged, layout, len(payload))
