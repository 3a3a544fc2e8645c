"""Scheduler lifecycle without a model: schedule → pretend the model ran → advance.

Every test ends with the pool empty (the leak check STYLE.md asks for).
"""

from __future__ import annotations

from splitserve.services.engine.block_pool import BlockPool
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.services.engine.scheduler import Scheduler, TransferHold
from splitserve.services.engine.sequence import FinishReason, Sequence, SequenceStatus, TransferUse

BS = 4


def make(num_blocks=16, budget=64, max_seqs=8) -> Scheduler:
    return Scheduler(BlockPool(num_blocks, BS), budget, max_seqs)


def seq(rid: str, n: int, arrival: int, max_tokens: int = 4) -> Sequence:
    return Sequence(rid, list(range(100 * arrival, 100 * arrival + n)), SamplingParams(max_tokens=max_tokens), arrival)


def run_step(s: Scheduler, token: int = 7):
    """Apply one schedule as the engine would; returns the decision."""
    out = s.schedule()
    for chunk in out.chunks:
        s.advance(chunk)
    for chunk in out.chunks:
        if chunk.completes:
            chunk.seq.output_token_ids.append(token)
            if len(chunk.seq.output_token_ids) >= chunk.seq.params.max_tokens:
                s.finish(chunk.seq, FinishReason.LENGTH)
    return out


def drain(s: Scheduler) -> int:
    steps = 0
    while s.has_work():
        run_step(s)
        steps += 1
        assert steps < 1000
    return steps


def assert_idle(s: Scheduler):
    assert not s.has_work() and not s.remote and not s.transfer_owned
    assert s.pool.num_free_blocks == s.pool.num_blocks and not any(s.pool.ref_counts)


def test_chunked_prefill_respects_the_token_budget():
    s = make(budget=8)
    a = seq("a", 20, 1)
    s.add(a)
    sizes = []
    while a.num_computed_tokens < 20:
        out = run_step(s)
        assert out.num_tokens <= 8
        sizes.append(out.chunks[0].num_tokens)
    assert sizes == [8, 8, 4]
    drain(s)
    assert_idle(s)


def test_decodes_are_scheduled_before_new_prefills_and_listed_first():
    s = make(budget=10)
    s.add(seq("a", 3, 1, max_tokens=5))
    run_step(s)                          # a prefilled, now decoding
    s.add(seq("b", 30, 2))
    out = run_step(s)
    assert [c.seq.request_id for c in out.chunks] == ["a", "b"]
    assert out.chunks[0].num_tokens == 1 and out.chunks[1].num_tokens == 9
    drain(s)
    assert_idle(s)


def test_admission_waits_for_free_blocks():
    s = make(num_blocks=4)
    s.add(seq("a", 12, 1, max_tokens=2))   # 3 blocks
    s.add(seq("b", 8, 2, max_tokens=2))    # 2 blocks: must wait
    out = run_step(s)
    assert [c.seq.request_id for c in out.chunks] == ["a"]
    assert s.waiting[0].request_id == "b"
    drain(s)
    assert_idle(s)


def test_preemption_recomputes_the_latest_arrival():
    s = make(num_blocks=5, budget=64)
    a, b = seq("a", 8, 1, max_tokens=6), seq("b", 8, 2, max_tokens=6)
    s.add(a)
    s.add(b)
    run_step(s)                                  # both prefilled: 4 blocks in use
    preempted = []
    while s.has_work():
        preempted += [p.request_id for p in run_step(s).preempted]
    assert "b" in preempted and "a" not in preempted
    assert b.num_preemptions >= 1 and a.output_token_ids == [7] * 6 and b.output_token_ids == [7] * 6
    assert_idle(s)


def test_prefix_hits_skip_computed_blocks_but_keep_one_token():
    s = make()
    first = seq("a", 8, 1, max_tokens=1)
    s.add(first)
    drain(s)
    again = Sequence("b", list(first.prompt_token_ids), SamplingParams(max_tokens=1), 2)
    s.add(again)
    out = run_step(s)
    # Both blocks are cached, but the last token must be computed to sample: block 2 is recomputed.
    assert out.chunks[0].start == 4 and out.chunks[0].num_tokens == 4
    assert again.num_prefix_hit_tokens == 4
    assert_idle(s)


def test_finish_of_waiting_running_and_reserved_sequences_frees_everything():
    s = make()
    running, waiting = seq("r", 10, 1, max_tokens=50), seq("w", 10, 2)
    s.add(running)
    run_step(s)
    s.max_num_seqs = 1
    s.add(waiting)
    remote = seq("x", 9, 3)
    assert s.reserve_remote(remote) is not None
    for victim in (running, waiting, remote):
        assert s.find(victim.request_id) is victim
        s.finish(victim, FinishReason.ABORT)
        assert victim.status is SequenceStatus.FINISHED
    assert_idle(s)


def test_a_new_shared_prefix_is_computed_once_not_side_by_side():
    s = make(budget=64)
    shared = list(range(500, 512))                      # 3 full blocks nobody has cached yet
    a = Sequence("a", shared + [1], SamplingParams(max_tokens=2), 1)
    b = Sequence("b", shared + [2], SamplingParams(max_tokens=2), 2)
    other = seq("c", 6, 3, max_tokens=2)                # no prefix in common: not held back
    for x in (a, b, other):
        s.add(x)
    first = run_step(s)
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in first.chunks] == [("a", 0, 13), ("c", 0, 6)]
    assert [w.request_id for w in s.waiting] == ["b"]   # waits for a's blocks, keeps its place
    second = run_step(s)
    assert ("b", 12, 1) in [(c.seq.request_id, c.start, c.num_tokens) for c in second.chunks]
    assert b.num_prefix_hit_tokens == 12
    drain(s)
    assert a.output_token_ids == b.output_token_ids == [7, 7]
    assert_idle(s)


def test_a_held_sequence_waits_for_a_chunked_prefill_to_pass_the_shared_blocks():
    s = make(num_blocks=32, budget=16)
    shared = list(range(600, 624))                      # 6 blocks: a prefills them in 2 steps of the budget
    a = Sequence("a", shared + [1], SamplingParams(max_tokens=1), 1)
    b = Sequence("b", shared + [2], SamplingParams(max_tokens=1), 2)
    s.add(a)
    s.add(b)
    admitted_at = None
    for step in range(1, 10):
        out = run_step(s)
        if any(c.seq is b for c in out.chunks):
            admitted_at = step
            break
    # Step 2 has budget left after a's last 9 tokens, but b's next block is one a computes in that
    # step: b starts in step 3 from token 24 instead of recomputing blocks 4 and 5 beside a.
    assert admitted_at == 3 and b.num_prefix_hit_tokens == 24
    drain(s)
    assert_idle(s)


def test_an_aborted_fenced_reservation_keeps_its_granted_blocks_until_released():
    s = make()
    a = seq("a", 12, 1, max_tokens=1)
    s.add(a)
    drain(s)                                           # caches a's two full blocks
    remote = Sequence("x", a.prompt_token_ids[:8] + [1, 2, 3, 4, 5], SamplingParams(max_tokens=2), 2,
                      transfer=TransferUse.RECEIVE)
    reservation = s.reserve_remote(remote)
    assert reservation is not None and reservation.num_cached_tokens == 8
    granted = reservation.block_ids[2:]                # what a prefill worker may be writing
    s.finish(remote, FinishReason.ABORT)
    assert remote.status is SequenceStatus.FINISHED and s.find("x") is None
    assert s.transfer_owned == {"x": TransferHold(TransferUse.RECEIVE, granted)}
    assert s.pool.num_used_blocks == len(granted)      # the cached prefix went back, the grant did not
    assert s.transfer_done("x") and not s.transfer_done("x")
    assert_idle(s)


def test_a_completed_fenced_reservation_is_an_ordinary_sequence():
    s = make()
    remote = Sequence("x", list(range(10)), SamplingParams(max_tokens=1), 1, transfer=TransferUse.RECEIVE)
    assert s.reserve_remote(remote) is not None
    assert s.complete_remote("x") is remote
    s.finish(remote, FinishReason.LENGTH)              # every write landed before completion
    assert s.transfer_owned == {}
    assert_idle(s)


# -- blocks a transfer owns after its request finished (one state, one release) -----------

def prefill_only(rid: str, n: int, arrival: int) -> Sequence:
    return Sequence(rid, list(range(100 * arrival, 100 * arrival + n)), SamplingParams(max_tokens=1), arrival,
                    prefill_only=True, transfer=TransferUse.SEND)


def prefill(s: Scheduler, seq: Sequence) -> None:
    """Run `seq` through its prompt and finish it the way the engine ends a prefill-only one."""
    s.add(seq)
    while seq.num_pending_tokens:
        for chunk in s.schedule().chunks:
            s.advance(chunk)
    s.finish(seq, FinishReason.PREFILL_DONE)


def test_a_finished_prefill_leaves_every_block_to_its_sender_until_transfer_done():
    s = make()
    p = prefill_only("p", 10, 1)
    prefill(s, p)
    assert p.status is SequenceStatus.FINISHED and s.find("p") is None and not s.has_work()
    assert s.transfer_owned["p"].use is TransferUse.SEND
    assert len(s.transfer_owned["p"].block_ids) == 3 == s.pool.num_used_blocks
    assert p.block_ids == []                           # the hold, not the sequence, has them now
    assert s.transfer_done("p") and not s.transfer_done("p")
    assert_idle(s)


def test_an_aborted_prefill_sends_nothing_more_and_frees_at_once():
    s = make(budget=4)
    p = prefill_only("p", 10, 1)
    s.add(p)
    run_step(s)                                        # one chunk of the prompt computed
    assert s.pool.num_used_blocks == 1
    s.finish(p, FinishReason.ABORT)
    assert not s.transfer_done("p")
    assert_idle(s)


def test_a_reservation_without_a_transfer_marker_frees_everything_when_given_up():
    s = make()
    remote = seq("x", 10, 1)
    assert s.reserve_remote(remote) is not None
    s.finish(remote, FinishReason.ABORT)
    assert not s.transfer_done("x")
    assert_idle(s)


def test_a_request_id_given_up_twice_keeps_both_grants_until_one_transfer_done():
    s = make()
    granted = []
    for arrival in (1, 2):                             # the same request retried on this worker
        remote = Sequence("x", list(range(300, 310)), SamplingParams(max_tokens=1), arrival,
                          transfer=TransferUse.RECEIVE)
        reservation = s.reserve_remote(remote)
        assert reservation is not None and reservation.num_cached_tokens == 0
        granted += reservation.block_ids
        s.finish(remote, FinishReason.ABORT)
    assert s.transfer_owned == {"x": TransferHold(TransferUse.RECEIVE, granted)}
    assert s.pool.num_used_blocks == 6
    assert s.transfer_done("x")
    assert_idle(s)


def test_transfer_holds_of_both_kinds_leave_the_pool_all_free_in_any_order():
    s = make(num_blocks=16)
    prefill(s, prefill_only("p", 9, 1))                # 3 blocks held for a sender
    remote = Sequence("d", list(range(700, 710)), SamplingParams(max_tokens=1), 2, transfer=TransferUse.RECEIVE)
    assert s.reserve_remote(remote) is not None
    s.finish(remote, FinishReason.ABORT)               # 3 granted blocks held for a writer
    other = seq("o", 6, 3, max_tokens=2)
    s.add(other)
    drain(s)                                           # an ordinary request comes and goes meanwhile
    assert set(s.transfer_owned) == {"p", "d"} and s.pool.num_used_blocks == 6
    assert s.transfer_done("d") and s.pool.num_used_blocks == 3
    assert not s.transfer_done("unknown") and s.pool.num_used_blocks == 3
    assert s.transfer_done("p")
    assert_idle(s)


def test_cache_salt_shares_blocks_only_within_one_salt():
    """vLLM's cache_salt: a prompt computed under one salt is a prefix-cache hit for the same
    salt only; unsalted requests share with each other, never with salted ones."""
    s = make(num_blocks=32)
    prompt = list(range(12))                                   # 3 full blocks

    def run(rid: str, arrival: int, salt: str) -> int:
        q = Sequence(rid, list(prompt), SamplingParams(max_tokens=1, cache_salt=salt), arrival)
        s.add(q)
        drain(s)
        return q.num_prefix_hit_tokens

    assert run("a", 1, "tenant-a") == 0
    assert run("b", 2, "tenant-b") == 0                       # another salt: computed again
    assert run("plain", 3, "") == 0                           # no salt: not the salted blocks either
    assert run("a2", 4, "tenant-a") == 8                      # same salt: the cached blocks (all but the last)
    assert run("plain2", 5, "") == 8
    assert_idle(s)


def test_a_reservation_leaves_each_running_sequence_a_block_to_grow_into():
    s = make(num_blocks=8)
    a, b = seq("a", 4, 1, max_tokens=8), seq("b", 4, 2, max_tokens=8)       # one full block each
    s.add(a)
    s.add(b)
    run_step(s)
    assert s.pool.num_free_blocks == 6
    # 5 blocks would leave 1 free for 2 running sequences: the first to grow would preempt.
    assert s.reserve_remote(seq("x", 20, 3)) is None
    assert s.pool.num_free_blocks == 6 and not s.remote
    assert s.reserve_remote(seq("y", 16, 4)) is not None           # 4 blocks: 2 stay free
    assert s.pool.num_free_blocks == 2
    for _ in range(3):                                              # a and b each take their next block
        assert not run_step(s).preempted
    s.finish(s.remote["y"], FinishReason.ABORT)
    drain(s)
    assert s.num_preemptions == 0
    assert_idle(s)
