"""The checksums of KV that moves (issue 41): the transfer digest's envelopes and the block frame."""

from __future__ import annotations

import pytest
import torch

from splitserve.kvtransfer import KVLayout
from splitserve.kvtransfer import block_codec, transfer_digest

LAYOUT = KVLayout(model="m", dtype="float32", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)


@pytest.fixture
def pool() -> torch.Tensor:
    return torch.randn(LAYOUT.pool_shape(6), generator=torch.Generator().manual_seed(0))


PAGED = KVLayout(model="m", dtype="float32", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4,
                 layout="paged-heads-kv-v1")


def _sent(layout: KVLayout, pool: torch.Tensor, chunks: list[tuple[list[int], list[int]]]) -> tuple[int, int]:
    """The sender's stream digest of writes posted chunk by chunk, every layer of each chunk."""
    sent = transfer_digest.StreamDigest(layout)
    for src, dst in chunks:
        for layer in range(layout.num_layers):
            sent.add_write(pool, layer, src, dst)
    return sent.result()


@pytest.mark.parametrize("layout", [LAYOUT, PAGED], ids=["layer-major", "paged"])
def test_the_stream_digest_matches_what_the_granted_blocks_hold_however_the_writes_were_split(layout):
    """A prompt's blocks posted in chunks (as a chunked prefill posts them), from source blocks
    that are not consecutive where the granted ones are, digest to what the receiver's granted
    blocks hold once every byte landed; a flipped value, a block landed elsewhere or a layer
    missing does not."""
    source = torch.randn(layout.pool_shape(8), generator=torch.Generator().manual_seed(1))
    src, granted = [5, 0, 1, 2, 7], [2, 3, 4, 6, 7]
    sent = _sent(layout, source, [(src[:2], granted[:2]), (src[2:], granted[2:])])
    assert sent == _sent(layout, source, [(src, granted)])               # the split does not matter
    held = torch.zeros_like(source)
    block_axis = 1 if layout.paged else 2
    held.index_copy_(block_axis, torch.tensor(granted), source.index_select(block_axis, torch.tensor(src)))
    assert transfer_digest.held_digest(held, layout, granted, transfer_digest.STREAM) == sent
    flipped = held.clone()
    flipped[(1, 6, 1, 1, 2, 3) if layout.paged else (1, 1, 6, 2, 1, 3)] += 1.0    # a V value of granted block 6
    swapped = held.index_copy(block_axis, torch.tensor([3, 4]), held.index_select(block_axis, torch.tensor([4, 3])))
    missing = held.clone()
    missing[2] = 0.0
    for damaged in (flipped, swapped, missing):
        assert transfer_digest.held_digest(damaged, layout, granted, transfer_digest.STREAM) != sent


@pytest.mark.parametrize("algorithm", [transfer_digest.XXH3, transfer_digest.CRC32])
def test_an_earlier_senders_envelope_names_its_hash_and_the_receiver_recomputes_it(pool, algorithm):
    blocks = [1, 4]
    total = 0
    for layer in range(LAYOUT.num_layers):
        total = transfer_digest.add(total, transfer_digest.digest(pool, LAYOUT, layer, blocks, blocks, algorithm))
    sealed = transfer_digest.seal(b"payload", total, LAYOUT.num_layers * len(blocks), algorithm)
    sent, inner = transfer_digest.unseal(sealed)
    assert inner == b"payload" and sent[2] == algorithm
    assert transfer_digest.held_digest(pool, LAYOUT, blocks, sent[2]) == sent[:2]
    pool[1, 0, 4, 2, 1, 3] += 1.0                        # one value of one layer of one block
    assert transfer_digest.held_digest(pool, LAYOUT, blocks, sent[2]) != sent[:2]
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
