"""The router and a worker's lower KV tiers: host/disk events in their own maps, the shared store's
blocks for every worker attached to it, overlap per tier, and the kv cost's credit for them (worked
examples with known costs)."""

from __future__ import annotations

import pytest

from splitserve.proto.v1 import worker_pb2
from splitserve.router.core import RouterCore, WorkerSpec
from splitserve.block_hashes import block_hashes
from splitserve.router.index import REMOVED, STORED, KvIndex
from splitserve.router.policies import make_policy
from splitserve.router.policies.base import Candidate
from splitserve.router.policies.kv import KvPolicy, kv_cost
from splitserve.router.subscriber import EventSubscriber
from splitserve.testing.clock import FakeClock

H = [bytes([i]) * 32 for i in range(8)]


def test_lower_tier_events_never_touch_device_entries():
    index = KvIndex()
    index.stored("w", H[:4])
    index.apply_tier("w", "host", STORED, H[:6])        # evicted copies of 0-3 plus 4, 5
    index.apply_tier("w", "host", REMOVED, H[:2])       # the host tier drops 0 and 1
    assert index.overlaps(H) == {"w": 4}                 # the device still holds 0-3
    assert index.tiered_overlaps(H) == {"w": (4, 6, 6, 6)}
    index.apply_tier("w", "disk", STORED, [H[6]])
    assert index.tiered_overlaps(H) == {"w": (4, 6, 7, 7)}
    index.removed("w", H[:4])                            # device evicts 0-3: host holds only 2, 3 of them
    assert index.tiered_overlaps(H) == {}
    index.apply_tier("w", "gpu-l3", STORED, H)           # a tier this router does not know: ignored
    assert index.tiered_overlaps(H) == {}
    index.clear_worker("w")
    assert not index.has_lower_tiers() and index.num_tier_blocks("w", "host") == 0


def test_subscriber_routes_each_event_to_its_tier_in_order():
    index = KvIndex()
    sub = EventSubscriber("w", index)
    ev = [worker_pb2.KvEvent(seq=1, stored=worker_pb2.BlockStored(block_hashes=H[:3], tier="device")),
          worker_pb2.KvEvent(seq=2, removed=worker_pb2.BlockRemoved(block_hashes=H[2:3], tier="device")),
          worker_pb2.KvEvent(seq=3, stored=worker_pb2.BlockStored(block_hashes=H[2:4], tier="host")),
          worker_pb2.KvEvent(seq=4, removed=worker_pb2.BlockRemoved(block_hashes=H[3:4], tier="host")),
          worker_pb2.KvEvent(seq=5, stored=worker_pb2.BlockStored(block_hashes=H[3:5], tier="disk")),
          worker_pb2.KvEvent(seq=6, stored=worker_pb2.BlockStored(block_hashes=H[5:6]))]   # no tier: device
    sub.apply(worker_pb2.KvEventBatch(worker_id="w", instance_id="i", snapshot=True, last_seq=6, events=ev))
    assert index.overlaps(H) == {"w": 2}
    assert index.tiered_overlaps(H) == {"w": (2, 3, 6, 6)}           # block 5 is back on the device
    assert index.num_blocks("w") == 3 and index.num_tier_blocks("w", "host") == 1
    cleared = worker_pb2.KvEvent(seq=7, cleared=worker_pb2.AllCleared())
    sub.apply(worker_pb2.KvEventBatch(worker_id="w", instance_id="i", last_seq=7, events=[cleared]))
    assert index.tiered_overlaps(H) == {} and not index.has_lower_tiers()


# -- the cost, worked: a 66-block prompt whose first 64 blocks are a shared prefix, weight 2 ---------
def test_a_host_hit_beats_nothing_and_a_device_hit_beats_a_host_hit():
    policy = KvPolicy()
    nothing = Candidate("none")
    host = Candidate("host", overlap_blocks=0, tier_credit_blocks=0.9 * 64)
    device = Candidate("device", overlap_blocks=64)
    assert kv_cost(66, nothing).cost == 132                        # 2 · 66
    assert kv_cost(66, host).cost == pytest.approx(2 * (66 - 57.6))   # 16.8: only 2 + 6.4 blocks' worth
    assert kv_cost(66, device).cost == 4                           # 2 · 2
    assert policy.choose(66, [nothing, host]).winner.worker_id == "host"
    assert policy.choose(66, [host, device]).winner.worker_id == "device"
    # The device holder still wins with 12 blocks of work queued (4 + 12 = 16 < 16.8), not with 13.
    assert policy.choose(66, [host, Candidate("device", 64, pending_prefill_blocks=12)]).winner.worker_id == "device"
    assert policy.choose(66, [host, Candidate("device", 64, pending_prefill_blocks=13)]).winner.worker_id == "host"
    # The column fast path agrees with kv_cost.
    assert policy.choose(66, [nothing, host, device]).winner.cost == 4


def test_core_credits_each_tier_at_its_share():
    core = RouterCore(make_policy("kv"), make_policy("kv"), clock=FakeClock(100.0),
                      tier_credit={"host": 0.9, "disk": 0.5})
    for w in ("a", "b", "c"):
        core.set_spec(w, WorkerSpec(16, b"m|"))
    prompt = list(range(16 * 10 + 3))                              # 10 full blocks
    chain = block_hashes(prompt, 16, b"m|")
    core.index.stored("a", chain[:2])
    core.index.apply_tier("a", "host", STORED, chain[2:6])
    core.index.apply_tier("a", "disk", STORED, chain[6:10])
    core.index.apply_tier("b", "disk", STORED, chain[:10])
    table, num_blocks = core.candidates(prompt, ["a", "b", "c"])
    assert num_blocks == 10
    assert list(table.overlap_blocks) == [2, 0, 0]
    assert table.tier_credit_blocks == pytest.approx([0.9 * 4 + 0.5 * 4, 0.5 * 10, 0.0])
    decision = core.route("r", prompt, ["a", "b", "c"], [])
    assert decision.decode.winner.worker_id == "a"                 # 2 + 5.6 of 10 blocks' worth
    assert "tier_credit=5.6" in decision.decode.explain()


def test_a_store_block_counts_for_every_attached_worker_and_its_eviction_for_all():
    index = KvIndex()
    index.apply_tier("a", "store", STORED, H[:4])          # a published 0-3
    index.apply_tier("b", "store", STORED, [])             # b attached, published nothing
    index.stored("c", H[:1])                               # c has no store
    assert index.tiered_overlaps(H) == {"a": (0, 0, 0, 4), "b": (0, 0, 0, 4), "c": (1, 1, 1, 1)}
    index.apply_tier("b", "store", STORED, H[4:6])
    index.apply_tier("b", "store", REMOVED, H[2:3])        # b's offer evicted block 2, a's report
    assert index.tiered_overlaps(H)["a"] == (0, 0, 0, 2) and index.num_tier_blocks("a", "store") == 5
    index.clear_worker("a")                                # a leaves: b still fetches what a reported
    assert index.tiered_overlaps(H) == {"b": (0, 0, 0, 2), "c": (1, 1, 1, 1)}
    assert index.num_tier_blocks("a", "store") == 0 and index.num_tier_blocks("c", "store") == 0
    index.clear_worker("b")                                # nobody attached: nothing to trust
    assert not index.has_lower_tiers()


def test_core_credits_a_store_hit_below_a_host_hit():
    core = RouterCore(make_policy("kv"), make_policy("kv"), clock=FakeClock(100.0),
                      tier_credit={"host": 0.9, "store": 0.5})
    for w in ("a", "b"):
        core.set_spec(w, WorkerSpec(16, b"m|"))
    prompt = list(range(16 * 10 + 3))
    chain = block_hashes(prompt, 16, b"m|")
    core.index.apply_tier("a", "host", STORED, chain[:10])
    core.index.apply_tier("b", "store", STORED, chain[:10])   # b published it; a is not attached
    table, _ = core.candidates(prompt, ["a", "b"])
    assert table.tier_credit_blocks == pytest.approx([9.0, 5.0])
    core.index.apply_tier("a", "store", STORED, [])           # a attaches too: host first, nothing more
    table, _ = core.candidates(prompt, ["a", "b"])
    assert table.tier_credit_blocks == pytest.approx([9.0, 5.0])
    assert core.route("r", prompt, ["a", "b"], []).decode.winner.worker_id == "a"     # 2·1 < 2·5
