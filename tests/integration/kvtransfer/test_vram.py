"""VRAM pools (CUDA tensors) on both backends: NIXL registers VRAM, TCP stages through host memory.

Run by the device check only (`-m gpu`); CI has no GPU.
"""

from __future__ import annotations

import pytest
import torch

from splitserve.kvtransfer.peer import layout_dict


@pytest.mark.gpu
def test_vram_to_vram_is_byte_exact(fresh_peers, layout_for):
    layout = layout_for("bfloat16")
    sender, receiver = fresh_peers.start_raw(), fresh_peers.start_raw()
    sender.call("setup", fresh_peers.backend, "prefill-gpu", layout_dict(layout), 48, 1, 10.0, device="cuda:0")
    meta = receiver.call("setup", fresh_peers.backend, "decode-gpu", layout_dict(layout), 48, None, 10.0,
                         device="cuda:0")
    sender.call("add_peer", meta)
    src, dst = [0, 1, 2, 9, 30], [47, 3, 4, 5, 10]
    reservation = receiver.call("reserve", "gpu", dst, 30.0)
    sender.call("send_request", reservation, src, dst, b"tok")
    assert receiver.call("wait_notification", "gpu", 10.0) == b"tok"
    got, want = receiver.call("pool"), sender.call("pool")
    assert torch.equal(got[:, :, dst].view(torch.uint8), want[:, :, src].view(torch.uint8))
    assert receiver.call("active_reservations") == {}
