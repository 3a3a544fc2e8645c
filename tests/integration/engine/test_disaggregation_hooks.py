"""The engine hooks of the disaggregated path, with an in-process copy as the transfer.

A prefill-only request on engine A reports each finished layer; the callback
copies that layer's blocks into the blocks engine B reserved; B then decodes
from A's first token. The result must equal aggregated serving on one engine.
(The real cross-process transfer is kvtransfer's job, issue 3.)
"""

from __future__ import annotations

import pytest

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.kvtransfer.sender_receiver import LayerReady
from splitserve.services.engine.sequence import FinishReason

PROMPT = list(range(100, 170))            # 70 tokens: 4 full blocks and a partial one


def make_engine(folder, **kw):
    return LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=64, **kw))


def disaggregated(prefill: LLMEngine, decode: LLMEngine, request_id: str, prompt, params):
    reservation = decode.reserve_remote_prefill(request_id, prompt, params)
    assert reservation is not None
    reports: list[LayerReady] = []

    def push(ready: LayerReady) -> None:
        reports.append(ready)
        src = prefill.runner.kv.tensor[ready.layer]
        dst = decode.runner.kv.tensor[ready.layer]
        for offset, block_id in enumerate(ready.block_ids):
            dst[:, reservation.block_ids[ready.first_block + offset]] = src[:, block_id]

    prefill.add_request(request_id, prompt, SamplingParams(max_tokens=1), prefill_only=True,
                        on_layer_done=push)
    first = None
    while prefill.has_unfinished():
        for out in prefill.step():
            assert out.finish_reason is FinishReason.PREFILL_DONE
            [first] = out.new_token_ids
    # The prefill side holds its blocks until the transfer is done with them.
    assert prefill.num_held_requests == 1 and prefill.pool.num_used_blocks > 0
    assert prefill.release_transfer(request_id) and not prefill.release_transfer(request_id)
    tokens = list(decode.complete_remote_prefill(request_id, first).new_token_ids)
    while decode.has_unfinished():
        for out in decode.step():
            tokens.extend(out.new_token_ids)
    return tokens, reports


@pytest.mark.parametrize("chunk", [2048, 32])
def test_disaggregated_equals_aggregated(llama_dir, chunk):
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    [expected] = make_engine(llama_dir).generate([PROMPT], params)
    prefill = make_engine(llama_dir, max_num_batched_tokens=chunk)
    decode = make_engine(llama_dir)
    tokens, reports = disaggregated(prefill, decode, "r1", PROMPT, params)
    assert tokens == expected.token_ids
    num_layers = prefill.model_config.num_layers
    num_chunks = -(-len(PROMPT) // chunk)
    assert [r.layer for r in reports] == list(range(num_layers)) * num_chunks
    assert reports[-1].num_tokens == len(PROMPT)
    for engine in (prefill, decode):
        assert not engine.has_unfinished() and engine.pool.num_used_blocks == 0


def test_prefill_side_prefix_hits_are_sent_too(llama_dir):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    [expected] = make_engine(llama_dir).generate([PROMPT], params)
    prefill = make_engine(llama_dir)
    prefill.generate([PROMPT], SamplingParams(max_tokens=1))    # warms A's prefix cache
    decode = make_engine(llama_dir)
    tokens, reports = disaggregated(prefill, decode, "r2", PROMPT, params)
    assert tokens == expected.token_ids
    assert reports[0].first_block == 0 and len(reports[0].block_ids) == 5


def test_decode_side_reservation_reuses_its_cache_and_is_released_on_abort(llama_dir):
    decode = make_engine(llama_dir)
    decode.generate([PROMPT], SamplingParams(max_tokens=1))
    params = SamplingParams(max_tokens=4)
    reservation = decode.reserve_remote_prefill("r3", PROMPT, params)
    assert reservation.num_cached_tokens == 64 and len(reservation.block_ids) == 5
    assert decode.abort("r3")
    assert decode.pool.num_used_blocks == 0
    assert decode.complete_remote_prefill("r3", 5) is None


def test_reservation_returns_none_when_the_pool_is_full(llama_dir):
    decode = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=10))
    assert decode.reserve_remote_prefill("first", list(range(1, 101)), SamplingParams()) is not None
    assert decode.reserve_remote_prefill("second", list(range(2, 102)), SamplingParams()) is None
    assert decode.pool.num_used_blocks == 7
    assert decode.abort("first") and not decode.abort("second")
    assert decode.pool.num_used_blocks == 0 and not decode.has_unfinished()


def test_abort_releases_held_prefill_blocks_and_cancel_gives_back_a_reservation(llama_dir):
    prefill = make_engine(llama_dir)
    prefill.add_request("p", PROMPT, SamplingParams(max_tokens=1), prefill_only=True,
                        on_layer_done=lambda ready: None)
    while prefill.has_unfinished():
        prefill.step()
    assert prefill.pool.num_used_blocks == 5
    assert prefill.abort("p")
    assert prefill.pool.num_used_blocks == 0 and prefill.num_held_requests == 0

    decode = make_engine(llama_dir)
    assert decode.reserve_remote_prefill("d", PROMPT, SamplingParams(max_tokens=3)) is not None
    assert decode.cancel_remote_prefill("d") and not decode.cancel_remote_prefill("d")
    assert decode.step() == [] and decode.pool.num_used_blocks == 0
    decode.add_request("d", PROMPT, SamplingParams(max_tokens=3))   # prefilled locally instead
    outputs = []
    while decode.has_unfinished():
        outputs.extend(decode.step())
    assert sum(len(o.new_token_ids) for o in outputs) == 3 and decode.pool.num_used_blocks == 0
