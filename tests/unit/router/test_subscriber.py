"""EventSubscriber.apply: snapshots, live events, gaps and restarts (pure, no sockets)."""

from __future__ import annotations

from splitserve.proto.v1 import worker_pb2
from splitserve.router.index import KvIndex
from splitserve.router.subscriber import Applied, EventSubscriber, GapDetected, Restarted


def stored(seq, *hashes):
    return worker_pb2.KvEvent(seq=seq, stored=worker_pb2.BlockStored(block_hashes=list(hashes)))


def removed(seq, *hashes):
    return worker_pb2.KvEvent(seq=seq, removed=worker_pb2.BlockRemoved(block_hashes=list(hashes)))


def batch(instance, last_seq, events, snapshot=False):
    return worker_pb2.KvEventBatch(worker_id="w", instance_id=instance, snapshot=snapshot, last_seq=last_seq,
                                   events=events)


def test_snapshot_then_live_then_gap_then_restart():
    index = KvIndex()
    sub = EventSubscriber("w", index)
    index.stored("w", [b"stale"])
    assert sub.apply(batch("i1", 5, [stored(0, b"a"), stored(0, b"b")], snapshot=True)) == Applied(2)
    assert not index.holds("w", b"stale") and sub.last_seq == 5
    assert sub.apply(batch("i1", 7, [stored(6, b"c"), removed(7, b"a")])) == Applied(2)
    assert index.overlaps([b"b"]) == {"w": 1} and index.overlaps([b"a"]) == {}
    assert sub.apply(batch("i1", 10, [stored(8, b"d"), stored(10, b"e")])) == GapDetected(9, 10)
    assert index.holds("w", b"d") and sub.last_seq == 8
    assert sub.apply(batch("i2", 1, [stored(1, b"x")])) == Restarted("i1", "i2")
    assert sub.apply(batch("i2", 3, [stored(0, b"x")], snapshot=True)) == Applied(1)
    assert index.num_blocks("w") == 1 and sub.instance_id == "i2"


def test_cleared_and_live_before_snapshot():
    index = KvIndex()
    sub = EventSubscriber("w", index)
    assert isinstance(sub.apply(batch("i1", 2, [stored(2, b"a")])), GapDetected)   # never synced
    sub.apply(batch("i1", 2, [stored(0, b"a")], snapshot=True))
    sub.apply(batch("i1", 3, [worker_pb2.KvEvent(seq=3, cleared=worker_pb2.AllCleared())]))
    assert index.num_blocks("w") == 0
