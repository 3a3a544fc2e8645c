"""Migration bookkeeping: the next worker call, when migration is refused, and stop strings
judged by the frontend across a migration (the new worker sees only its own tokens)."""

from __future__ import annotations

import asyncio
import time

import pytest

from splitserve.proto.v1 import worker_pb2
from splitserve.checkpoints.model_source import open_checkpoint
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.services.text.stop_checker import StopChecker
from splitserve.services.text.tokenizer import Tokenizer
from splitserve.services.worker_protocol.proto_conversion import params_from_proto
from splitserve.services.frontend.core import Frontend, _Refused, _Run
from splitserve.services.frontend.generation_request import GenerationRequest
from splitserve.services.frontend.metrics import FrontendMetrics
from splitserve.services.frontend.migration import MigrationPolicy, Progress, Refusal
from splitserve.services.frontend.routing import build_router
from splitserve.services.frontend.workers.pool import WorkerHandle, WorkerPool

PROMPT = [1, 415, 2936, 9060]


def test_next_worker_call_carries_forwarded_tokens_budget_and_draws():
    greedy = Progress("r", PROMPT, SamplingParams(max_tokens=10))
    assert greedy.worker_request().request_id == "r"
    greedy.token_ids += [7, 8, 9]
    greedy.num_migrations = 1
    call = greedy.worker_request()
    assert call.request_id == "r.m1" and list(call.token_ids) == PROMPT + [7, 8, 9]
    params = params_from_proto(call.params)
    assert params.max_tokens == 7 and params.num_prior_draws == 0
    seeded = Progress("s", PROMPT, SamplingParams(max_tokens=10, temperature=0.7, seed=3), token_ids=[5, 6])
    params = params_from_proto(seeded.worker_request().params)
    assert (params.seed, params.num_prior_draws, params.max_tokens) == (3, 2, 8)


def test_next_worker_call_counts_forwarded_tokens_as_output_for_penalties_and_min_tokens():
    first = SamplingParams(max_tokens=10, frequency_penalty=1.0, min_tokens=4, logit_bias={5: -3.0})
    p = Progress("r", PROMPT, first, token_ids=[5, 6, 5])
    params = params_from_proto(p.worker_request().params)
    assert (params.num_prior_output_tokens, params.min_tokens, params.max_tokens) == (3, 1, 7)
    assert params.frequency_penalty == 1.0 and params.logit_bias == {5: -3.0}
    # A second migration: the earlier worker's prompt already held 3 output tokens.
    again = Progress("r", PROMPT + [5, 6, 5], params, token_ids=[9, 9])
    params = params_from_proto(again.worker_request().params)
    assert (params.num_prior_output_tokens, params.min_tokens, params.max_tokens) == (5, 0, 5)


def test_next_worker_call_keeps_token_masks_and_salt_and_asks_prompt_logprobs_only_before_any_token():
    first = SamplingParams(max_tokens=10, allowed_token_ids=[5, 6, 9], bad_words=[[6, 5]], prompt_logprobs=2,
                           cache_salt="tenant")
    before_any = Progress("r", PROMPT, first)
    call = before_any.worker_request()
    assert call.cache_salt == "tenant" and params_from_proto(call.params).prompt_logprobs == 2
    p = Progress("r", PROMPT, first, token_ids=[5, 6])
    call = p.worker_request()
    params = params_from_proto(call.params, call.cache_salt)
    assert params.allowed_token_ids == [5, 6, 9] and params.bad_words == [[6, 5]]
    assert params.cache_salt == "tenant" and params.num_prior_output_tokens == 2
    assert params.prompt_logprobs is None        # the client got them with the first token


def test_refusals():
    p = Progress("r", PROMPT, SamplingParams(max_tokens=10), token_ids=[5])
    assert MigrationPolicy(0).refusal(p, 100) is Refusal.DISABLED
    assert MigrationPolicy(2).refusal(p, 100) is None
    p.num_migrations = 2
    assert MigrationPolicy(2).refusal(p, 100) is Refusal.LIMIT
    p.num_migrations = 0
    assert MigrationPolicy(2).refusal(p, len(PROMPT) + 1) is Refusal.CONTEXT_FULL


@pytest.fixture(scope="module")
def frontend(llama_dir):
    pool = WorkerPool()
    return Frontend(Tokenizer(open_checkpoint(str(llama_dir))), pool, build_router(pool, "round-robin"), FrontendMetrics())


def _resp(token_ids, finished=False):
    return worker_pb2.TokenGenerateResponse(token_ids=token_ids, finished=finished, num_prompt_tokens=99)


def test_a_stop_string_spanning_the_migration_point_is_cut(frontend):
    tok = frontend.tokenizer
    output = tok.encode("The river flows into the sea near the old town", add_special_tokens=False)
    cut = 5                                   # tokens forwarded before the worker died
    text = tok.decode(output)
    # A stop string that starts in the forwarded tokens and ends in the next worker's.
    before, after = tok.decode(output[:cut]), tok.decode(output[:cut + 2])
    stop = text[len(before) - 3:len(after)]
    assert stop and len(before) - 3 > 0
    params = SamplingParams(max_tokens=40, stop=[stop])
    req = GenerationRequest("r", "completions", PROMPT, params)
    progress = Progress("r", PROMPT, params)
    run = _Run(StopChecker(tok, params))
    shown = frontend._delta(req, progress, run, _resp(output[:cut]), "r").text
    progress.num_migrations = 1           # the first worker's stream broke here
    # The new worker does not know the stop string began earlier: it keeps going.
    last = frontend._delta(req, progress, run, _resp(output[cut:]), "r.m1")
    assert last.finish_reason == "stop"
    assert shown + last.text == text[:text.index(stop)]
    assert progress.token_ids == output[:cut + 2] and last.token_ids == output[cut:cut + 2]
    assert (last.num_prompt_tokens, last.num_output_tokens) == (len(PROMPT), cut + 2)


def test_a_refused_migration_is_a_503_and_is_counted(llama_dir):
    pool = WorkerPool()
    fe = Frontend(Tokenizer(open_checkpoint(str(llama_dir))), pool, build_router(pool, "round-robin"), FrontendMetrics(),
                  migration=MigrationPolicy(0, wait_s=0.3))
    req = GenerationRequest("r", "chat", PROMPT, SamplingParams(max_tokens=10))
    progress = Progress("r", PROMPT, req.params, token_ids=[5, 6])
    with pytest.raises(_Refused) as info:
        fe._migrate(req, progress, "UNAVAILABLE: Socket closed", "d0")
    assert info.value.reason == "disabled" and info.value.error.status == 503
    assert "Socket closed" in info.value.error.message and "--migration-limit 0" in info.value.error.message
    assert progress.failed_worker_ids == {"d0"} and progress.num_migrations == 0
    assert fe.metrics.registry.get_sample_value("splitserve_migrations_total", {"outcome": "refused_disabled"}) == 1
    t0 = time.monotonic()
    with pytest.raises(_Refused) as info:          # no decode worker left to move it to, within --migration-wait
        asyncio.run(fe.route(req, Progress("r", PROMPT, req.params, num_migrations=1)))
    assert info.value.reason == "no_worker" and time.monotonic() - t0 >= 0.3


def test_stop_strings_wait_for_min_tokens_like_vllm(frontend):
    tok = frontend.tokenizer
    output = tok.encode("red and blue and green", add_special_tokens=False)
    ends = [i + 1 for i in range(len(output)) if tok.decode(output[:i + 1]).count(" and") == 1]
    first_end = ends[0]                        # the token that completes the first " and"

    def stops_at(min_tokens: int) -> int | None:
        checker = StopChecker(tok, SamplingParams(max_tokens=40, stop=[" and"], min_tokens=min_tokens))
        return next((i + 1 for i, t in enumerate(output) if checker.add(t)), None)

    assert stops_at(0) == first_end
    later = stops_at(first_end + 1)            # the first " and" is early: the second one stops it
    assert later is not None and later > first_end and tok.decode(output[:later]).count(" and") == 2


def test_a_migration_continues_only_on_a_worker_of_the_revision_that_began_the_response(llama_dir):
    """A rolling update (issue 41): a response begun by one weights revision is never finished by
    another; before its first token a request may go anywhere."""
    old, new = "weights=aaaa tokenizer=t engine=builtin/0.1.0", "weights=bbbb tokenizer=t engine=builtin/0.1.0"
    workers = {name: WorkerHandle(name, "decode", f"{name}:1", channel=None, stub=None, ready=True,
                                  info=worker_pb2.DescribeResponse(worker_id=name, max_model_len=1000, block_size=16,
                                                                   fingerprint=fingerprint))
               for name, fingerprint in (("d-old", old), ("d-new", new), ("d-new-2", new))}
    pool = WorkerPool(workers.values())
    fe = Frontend(Tokenizer(open_checkpoint(str(llama_dir))), pool, build_router(pool, "round-robin"), FrontendMetrics(),
                  migration=MigrationPolicy(2, wait_s=0.3))
    req = GenerationRequest("r", "completions", PROMPT, SamplingParams(max_tokens=10))
    fresh = Progress("r", PROMPT, req.params)
    first = asyncio.run(fe.route(req, fresh))
    assert fresh.fingerprint == first.decode.info.fingerprint
    begun = Progress("r", PROMPT, req.params, token_ids=[5, 6], fingerprint=new)
    fe._migrate(req, begun, "UNAVAILABLE: drained", "d-new")
    for _ in range(4):                                   # round-robin would offer d-old every other time
        assert asyncio.run(fe.route(req, begun)).decode is workers["d-new-2"]
    fe._migrate(req, begun, "UNAVAILABLE: drained", "d-new-2")
    with pytest.raises(_Refused) as info:                # only the old revision is left: refused, not mixed
        asyncio.run(fe.route(req, begun))
    assert info.value.reason == "no_worker" and "weights revision" in info.value.error.message
    not_begun = Progress("r", PROMPT, req.params, fingerprint=new)
    fe._migrate(req, not_begun, "UNAVAILABLE: drained", "d-new")
    fe._migrate(req, not_begun, "UNAVAILABLE: drained", "d-new-2")
    assert asyncio.run(fe.route(req, not_begun)).decode is workers["d-old"]    # no token sent yet: retried there
