"""Scheduler.fork without a model: the siblings of a prefilled prompt take its full blocks
by reference and a copy-on-write copy of the partial last one; every test ends idle."""

from __future__ import annotations

from splitserve.services.engine.block_pool import BlockPool
from splitserve.services.engine.scheduler import Scheduler
from splitserve.services.engine.sequence import FinishReason, Sequence, SequenceStatus
from splitserve.services.worker_protocol.sampling_params import SamplingParams

BS = 4


def prefilled(s: Scheduler, n_tokens: int) -> Sequence:
    parent = Sequence("p", list(range(n_tokens)), SamplingParams(max_tokens=4), 1)
    s.add(parent)
    out = s.schedule()
    for chunk in out.chunks:
        s.advance(chunk)
    return parent


def sibling(i: int) -> Sequence:
    return Sequence(f"s{i}", [], SamplingParams(max_tokens=4), 10 + i)


def assert_idle(s: Scheduler):
    assert not s.has_work()
    assert s.pool.num_free_blocks == s.pool.num_blocks and not any(s.pool.ref_counts)


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    s = Scheduler(BlockPool(16, BS), 64, 8)
    parent = prefilled(s, 10)                       # blocks: full, full, partial (2 tokens)
    sibs = [sibling(i) for i in range(3)]
    s.fork(parent, sibs)
    full, tail = parent.block_ids[:2], parent.block_ids[2]
    assert all(x.block_ids[:2] == full for x in sibs)
    assert [s.pool.ref_counts[b] for b in full] == [4, 4]
    copies = [x.block_ids[2] for x in sibs]
    assert len(set(copies) | {tail}) == 4
    assert s.pending_copies == [(tail, c) for c in copies]
    assert s.pool.ref_counts[tail] == 1 + 3 and all(s.pool.ref_counts[c] == 2 for c in copies)
    assert (s.num_forks, s.num_forked_blocks, s.num_fork_copies) == (3, 6, 3)
    out = s.schedule()                              # the copies go out with the next step
    assert out.block_copies == [(tail, c) for c in copies] and not s.pending_copies
    s.copies_done(out.block_copies)
    assert s.pool.ref_counts[tail] == 1 and all(s.pool.ref_counts[c] == 1 for c in copies)
    for x in [parent, *sibs]:
        s.finish(x, FinishReason.ABORT)
    assert_idle(s)


def test_a_sibling_without_a_block_for_its_copy_waits_and_nothing_leaks():
    s = Scheduler(BlockPool(4, BS), 64, 8)
    parent = prefilled(s, 10)                       # 3 of the 4 blocks
    a, b = sibling(0), sibling(1)
    s.fork(parent, [a, b])
    assert a.status is SequenceStatus.RUNNING and b.status is SequenceStatus.WAITING
    assert b.block_ids == [] and s.waiting[0] is b
    for x in (parent, a, b):
        s.finish(x, FinishReason.ABORT)
    s.schedule()                                    # nothing runs: the pending copy is dropped
    assert_idle(s)
