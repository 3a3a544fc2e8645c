"""The engine hooks of live migration, with an in-process copy as the transfer.

Engine A decodes a request, suspends it and reports its blocks as a sender would; the
callback copies them into the blocks engine B reserved for prompt + the output so far; B
computes the last token and decodes on. The continuation must equal the uninterrupted run,
greedy and seeded, also when the frontend had forwarded fewer tokens than A had made and when
the KV ends on a block boundary. (The cross-process transfer: tests/integration/faults/
test_live_migration.py.)
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from splitserve.errors import InvalidRequestError
from splitserve.kvtransfer.sender_receiver import LayerReady
from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.engine.sequence import FinishReason
from splitserve.services.worker_protocol.sampling_params import SamplingParams

PROMPT = list(range(100, 170))            # 70 tokens: 4 full blocks and a partial one (block size 16)
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, top_p=0.9, seed=7)


def make_engine(folder, **kw):
    return LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=64, **kw))


def run_until(engine: LLMEngine, request_id: str, num_tokens: int) -> list[int]:
    tokens: list[int] = []
    while len(tokens) < num_tokens:
        for out in engine.step():
            if out.request_id == request_id:
                tokens.extend(out.new_token_ids)
    return tokens


def finish(engine: LLMEngine, request_id: str) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                tokens.extend(out.new_token_ids)
    return tokens


def continued_params(params: SamplingParams, num_forwarded: int) -> SamplingParams:
    """What the frontend sends the next worker (migration.Progress.worker_request)."""
    return replace(params, max_tokens=params.max_tokens - num_forwarded,
                   num_prior_draws=num_forwarded if params.seed is not None else 0,
                   num_prior_output_tokens=num_forwarded)


def migrate(source: LLMEngine, target: LLMEngine, params: SamplingParams, made: int, forwarded: int
            ) -> tuple[list[int], list[int], list[LayerReady]]:
    """Run `made` tokens on the source, move the request after `forwarded` of them; the tokens
    forwarded and the target's continuation."""
    source.add_request("r", PROMPT, params)
    output = run_until(source, "r", made)
    assert source.suspend("r") == len(PROMPT) + len(output) - 1
    assert [o.finish_reason for o in source.step()] == [FinishReason.ABORT]   # its stream ends
    assert not source.has_unfinished()
    token_ids = PROMPT + output[:forwarded]
    reservation = target.reserve_migration("r.m1", token_ids, continued_params(params, forwarded))
    assert reservation is not None
    reports: list[LayerReady] = []

    def push(ready: LayerReady) -> None:
        reports.append(ready)
        src, dst = source.runner.kv.tensor[ready.layer], target.runner.kv.tensor[ready.layer]
        for offset, block_id in enumerate(ready.block_ids):
            dst[:, reservation.block_ids[ready.first_block + offset]] = src[:, block_id]

    assert source.export_suspended("r", "r.m1", token_ids, push) == len(token_ids) - 1
    assert source.release_suspended("r") and not source.release_suspended("r")
    assert source.pool.num_used_blocks == 0
    out = target.complete_migration("r.m1")
    assert out is not None and not out.new_token_ids and not out.finished
    return output[:forwarded], finish(target, "r.m1"), reports


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("made,forwarded", [(8, 8), (9, 6), (11, 11)],
                         ids=["all-forwarded", "fewer-forwarded", "kv-ends-on-a-block-boundary"])
def test_a_moved_request_continues_as_the_uninterrupted_one(llama_dir, params, made, forwarded):
    [expected] = make_engine(llama_dir).generate([PROMPT], params)
    source, target = make_engine(llama_dir), make_engine(llama_dir)
    sent, continued, reports = migrate(source, target, params, made, forwarded)
    assert sent + continued == expected.token_ids
    num_kv = len(PROMPT) + forwarded - 1
    assert {r.num_tokens for r in reports} == {num_kv}
    assert len(reports) == source.model_config.num_layers
    assert {len(r.block_ids) for r in reports} == {-(-num_kv // 16)}
    assert target.pool.num_used_blocks == 0 or not target.has_unfinished()


def test_what_cannot_be_suspended_or_exported(llama_dir):
    engine = make_engine(llama_dir, max_num_batched_tokens=32)
    assert engine.suspend("unknown") is None
    engine.add_request("r", PROMPT, GREEDY)
    assert engine.suspend("r") is None                  # waiting
    engine.step()                                        # a 32-token chunk of the prompt
    assert engine.suspend("r") is None                  # still prefilling
    output = run_until(engine, "r", 2)
    assert engine.suspend("r") == len(PROMPT) + len(output) - 1
    with pytest.raises(InvalidRequestError, match="other tokens"):
        engine.export_suspended("r", "x", PROMPT[:-1] + [PROMPT[-1] + 1, 5], lambda r: None)
    with pytest.raises(InvalidRequestError, match="other tokens"):
        engine.export_suspended("r", "x", PROMPT + output + [1, 2], lambda r: None)   # more than held
    with pytest.raises(InvalidRequestError, match="no suspended request"):
        engine.export_suspended("other", "x", PROMPT, lambda r: None)
    assert not engine.abort("r")                         # an abort does not free a suspended request
    assert engine.pool.num_used_blocks > 0
    assert engine.release_suspended("r") and engine.pool.num_used_blocks == 0


def test_a_migration_reservation_never_takes_the_last_token_from_the_cache(llama_dir):
    """The destination computes the last token itself: a cached copy of its block is not used
    (that block would be written into while shared)."""
    engine = make_engine(llama_dir)
    prompt = PROMPT[:64]                                   # 4 full blocks
    engine.generate([prompt], SamplingParams(max_tokens=1))
    reservation = engine.reserve_migration("m", prompt, GREEDY)
    assert reservation is not None and reservation.num_cached_tokens == 48        # not 64
    assert reservation.block_ids[3] not in engine.pool.cached.values()
    assert engine.cancel_remote_prefill("m") and engine.release_transfer("m")
    assert engine.pool.num_used_blocks == 0
