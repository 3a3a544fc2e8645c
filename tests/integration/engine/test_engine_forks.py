"""Several samples of one prompt (n > 1) on a real (random-weight) model: the prompt is
prefilled once, the samples share its full KV blocks by reference and each gets a copy of
the partial last block. Each sample's tokens must equal those of the same request run
alone (so the copied KV is right), and the pool must be idle after every test."""

from __future__ import annotations

import pytest

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.engine.sequence import FinishReason
from splitserve.services.worker_protocol.sampling_params import SamplingParams

BS = 16


def make_engine(llama_dir, num_blocks=64, prefix_caching=True) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=num_blocks,
                                  max_num_batched_tokens=256, block_size=BS,
                                  enable_prefix_caching=prefix_caching))


@pytest.fixture(scope="module")
def engine(llama_dir):
    return make_engine(llama_dir)


def params_for(i: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 10), temperature=1.0, seed=100 + i,
                          ignore_eos=True, **kw)


def run_forked(engine, prompt, n, **kw) -> dict[str, list[int]]:
    ids = [f"fork-{i}" for i in range(n)]
    engine.add_request(ids[0], prompt, params_for(0, **kw),
                       forks=[(ids[i], params_for(i, **kw)) for i in range(1, n)])
    tokens = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens


def run_alone(engine, prompt, i, **kw) -> list[int]:
    [r] = engine.generate([prompt], params_for(i, **kw))
    return r.token_ids


@pytest.mark.parametrize("prompt_len", [37, 48])   # a partial last block, and none
def test_forks_prefill_once_share_blocks_and_sample_like_separate_requests(llama_dir, prompt_len):
    engine = make_engine(llama_dir, prefix_caching=False)   # no cache: sharing is the fork's alone
    prompt = list(range(500, 500 + prompt_len))
    forked = run_forked(engine, prompt, 4)
    s = engine.stats
    assert s.num_prompt_tokens_computed == prompt_len            # one prefill for four samples
    assert s.num_forks == 3
    assert s.num_forked_blocks == 3 * (prompt_len // BS)
    assert s.num_fork_copies == (3 if prompt_len % BS else 0)
    alone = [run_alone(engine, prompt, i) for i in range(4)]
    assert [forked[f"fork-{i}"] for i in range(4)] == alone
    assert len({tuple(t) for t in alone}) > 1                     # the seeds differ, so do samples
    assert all(c == 0 for c in engine.pool.ref_counts)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_forked_blocks_are_referenced_by_every_sample_while_they_run(engine):
    prompt = list(range(700, 737))                                 # 2 full blocks + 5 tokens
    engine.add_request("a", prompt, params_for(0), forks=[("b", params_for(1)), ("c", params_for(2))])
    while not engine.scheduler.find("b"):
        engine.step()
    seqs = [engine.scheduler.find(r) for r in "abc"]
    shared = seqs[0].block_ids[:2]
    assert all(s.block_ids[:2] == shared for s in seqs)
    assert [engine.pool.ref_counts[b] for b in shared] == [3, 3]
    tails = {s.block_ids[2] for s in seqs}
    assert len(tails) == 3                                         # each sample its own tail block
    engine.step()
    assert [engine.pool.ref_counts[b] for b in tails] == [1, 1, 1]   # copies ran: holds dropped
    assert engine.abort("b")                                       # one sample's abort
    assert [engine.pool.ref_counts[b] for b in shared] == [2, 2]
    while engine.has_unfinished():
        engine.step()


def test_abort_of_the_prefilling_request_hands_its_siblings_on(engine):
    prompt = list(range(800, 900))
    engine.add_request("p", prompt, params_for(0, max_tokens=4),
                       forks=[("q", params_for(1, max_tokens=4)), ("r", params_for(2, max_tokens=4))])
    assert engine.abort("r")                          # a sibling not yet forked
    assert engine.abort("p")                          # the prefill's owner, before it ran
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert outs["p"][-1].finish_reason is FinishReason.ABORT
    assert outs["r"][-1].finish_reason is FinishReason.ABORT
    assert outs["q"][-1].finish_reason is FinishReason.LENGTH
    assert sum(len(o.new_token_ids) for o in outs["q"]) == 4
    assert not engine.abort("r")


def test_forks_survive_preemption_with_a_tight_pool(llama_dir):
    engine = make_engine(llama_dir, num_blocks=9)
    prompt = list(range(900, 937))                                 # 3 blocks each once decoding
    forked = run_forked(engine, prompt, 4, max_tokens=40)          # 37 + 40 tokens: 5 blocks each
    assert engine.stats.num_preemptions > 0
    assert engine.stats.num_forks >= 1
    assert all(c == 0 for c in engine.pool.ref_counts)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    alone = [run_alone(engine, prompt, i, max_tokens=40) for i in range(4)]
    assert [forked[f"fork-{i}"] for i in range(4)] == alone


def test_fork_ids_must_be_distinct(engine):
    from splitserve.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="distinct"):
        engine.add_request("x", [1, 2, 3], params_for(0), forks=[("x", params_for(1))])
    assert not engine.has_unfinished()


@pytest.mark.parametrize("prompt_len", [37, 48, 49])
def test_forks_after_a_remote_prefill_share_its_blocks_and_sample_like_separate_requests(llama_dir,
                                                                                        prompt_len):
    """The decode side reserves for the prompt, another engine fills it (a copy per layer, as
    test_disaggregation_hooks does), and the siblings fork when the KV has arrived: each
    recomputes only the last prompt token, into its own copy of that token's block."""
    prefill, decode = make_engine(llama_dir), make_engine(llama_dir, prefix_caching=False)
    prompt = list(range(300, 300 + prompt_len))
    forks = [(f"r{i}", params_for(i)) for i in range(1, 4)]
    reservation = decode.reserve_remote_prefill("r0", prompt, params_for(0), forks=forks)

    def push(ready):
        src, dst = prefill.runner.kv.tensor[ready.layer], decode.runner.kv.tensor[ready.layer]
        for offset, block_id in enumerate(ready.block_ids):
            dst[:, reservation.block_ids[ready.first_block + offset]] = src[:, block_id]

    prefill.add_request("r0", prompt, params_for(0, max_tokens=1), prefill_only=True, on_layer_done=push)
    first = None
    while prefill.has_unfinished():
        for out in prefill.step():
            [first] = out.new_token_ids
    assert prefill.release_transfer("r0")
    assert prefill.stats.num_prompt_tokens_computed == prompt_len          # one prefill
    tokens = {"r0": list(decode.complete_remote_prefill("r0", first).new_token_ids)}
    while decode.has_unfinished():
        for out in decode.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    s = decode.stats
    assert s.num_forks == 3 and s.num_forked_blocks == 3 * ((prompt_len - 1) // BS)
    assert s.num_fork_copies == 3
    assert s.num_prompt_tokens_computed == 3                                # the siblings' last token
    alone = [run_alone(prefill, prompt, i) for i in range(4)]
    assert [tokens[f"r{i}"] for i in range(4)] == alone
    for eng in (prefill, decode):
        assert all(c == 0 for c in eng.pool.ref_counts) and not eng.has_unfinished()


def test_forks_under_tensor_parallelism_copy_on_every_rank(llama_dir):
    """TP=2: each rank holds half the KV heads, so each must copy its own shard of the
    partial block (the copies travel with the broadcast batch) for the samples to be right."""
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=64,
                                    block_size=BS, tensor_parallel_size=2, enable_prefix_caching=False))
    try:
        prompt = list(range(600, 637))
        forked = run_forked(engine, prompt, 3)
        assert engine.stats.num_fork_copies == 2 and engine.stats.num_prompt_tokens_computed == 37
        alone = [run_alone(engine, prompt, i) for i in range(3)]
        assert [forked[f"fork-{i}"] for i in range(3)] == alone
        assert all(c == 0 for c in engine.pool.ref_counts)
    finally:
        engine.close()
