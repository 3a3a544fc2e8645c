"""Sampling controls survive a migration: a decode worker SIGKILLed mid-stream, its streams
continued on another one, every output token for token as the unbroken run.

The new worker gets prompt + forwarded tokens as its prompt; it must count the forwarded
tokens as output for presence/frequency penalties (SamplingParams.num_prior_output_tokens)
and against min_tokens. The engine-level checks show the counts matter: without
`num_prior_output_tokens` the continuation differs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.testing.models import EOS_TOKEN_ID
from splitserve.testing.workers import wait_idle

from .conftest import DECODE_FLAGS, FRONTEND_FLAGS, expected_outputs, make_jobs, run_killing

PENALTIES = dict(frequency_penalty=0.5, presence_penalty=-1.0, repetition_penalty=0.8)
PROMPT = [1, 415, 2936, 9060, 285, 1142, 28705]


@pytest.mark.parametrize("cut", [2, 6])
def test_resumed_request_counts_forwarded_tokens_as_output(engine, cut):
    [whole] = engine.generate([PROMPT], SamplingParams(max_tokens=16, ignore_eos=True, **PENALTIES))
    [plain] = engine.generate([PROMPT], SamplingParams(max_tokens=16, ignore_eos=True))
    assert whole.token_ids != plain.token_ids
    resumed_prompt = PROMPT + whole.token_ids[:cut]
    resumed = SamplingParams(max_tokens=16 - cut, ignore_eos=True, num_prior_output_tokens=cut, **PENALTIES)
    [rest] = engine.generate([resumed_prompt], resumed)
    assert whole.token_ids[:cut] + rest.token_ids == whole.token_ids
    [as_prompt] = engine.generate([resumed_prompt], replace(resumed, num_prior_output_tokens=0))
    assert as_prompt.token_ids != rest.token_ids      # forwarded tokens counted as prompt: not the same run


@pytest.mark.parametrize("cut", [1, 5])
def test_resumed_request_checks_bad_words_against_forwarded_output(engine, cut):
    """A two-token bad word whose first token the first worker generated: the new worker (which
    gets that token as prompt) must still ban the second, as the unbroken run did."""
    [plain] = engine.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))
    word = plain.token_ids[cut - 1:cut + 1]
    [whole] = engine.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True, bad_words=[word]))
    assert whole.token_ids[:cut] == plain.token_ids[:cut] and whole.token_ids[cut] != word[1]
    resumed = SamplingParams(max_tokens=12 - cut, ignore_eos=True, bad_words=[word], num_prior_output_tokens=cut)
    [rest] = engine.generate([PROMPT + whole.token_ids[:cut]], resumed)
    assert whole.token_ids[:cut] + rest.token_ids == whole.token_ids
    [as_prompt] = engine.generate([PROMPT + whole.token_ids[:cut]], replace(resumed, num_prior_output_tokens=0))
    assert as_prompt.token_ids[0] == word[1]          # the prompt is not output: the word is not checked


def test_sigkill_mid_stream_keeps_penalties_min_tokens_and_allowed_tokens_exact(cluster, llama_dir):
    eos = EOS_TOKEN_ID
    penalized = [replace(j, controls=PENALTIES) for j in make_jobs(6, seed=5, min_len=20, max_len=80, max_tokens=30)]
    # EOS is the greedy token at every step (bias +100); min_tokens holds it back across the cut.
    held = [replace(j, controls=dict(logit_bias={eos: 100.0}, min_tokens=20), ignore_eos=False)
            for j in make_jobs(4, seed=6, min_len=20, max_len=80, max_tokens=30)]
    # Only these may be sampled (greedy among them), before and after the cut.
    allowed = list(range(300, 340)) + [eos]
    masked = [replace(j, controls=dict(allowed_token_ids=allowed, frequency_penalty=0.4))
              for j in make_jobs(3, seed=7, min_len=20, max_len=80, max_tokens=30)]
    jobs = penalized + held + masked
    expected = expected_outputs(llama_dir, jobs)
    assert all(set(e) <= set(allowed) for e in expected[len(penalized) + len(held):])
    assert all(len(e) == 21 and e[-1] == eos and eos not in e[:-1] for e in expected[len(penalized):-len(masked)])
    p0 = cluster.start_worker("p0", "prefill")
    d0 = cluster.start_worker("d0", "decode", *DECODE_FLAGS)
    d1 = cluster.start_worker("d1", "decode", *DECODE_FLAGS)
    cluster.wait_workers()
    front = cluster.start_frontend(*FRONTEND_FLAGS)
    front.wait_ready()
    outcomes, served_by_d0 = run_killing(front, jobs, d0)
    errors = [(i, o.error) for i, o in enumerate(outcomes) if not o.completed]
    assert not errors, (errors, front.proc.tail(80))
    wrong = [(i, o.token_ids, want) for i, (o, want) in enumerate(zip(outcomes, expected)) if o.token_ids != want]
    assert not wrong, wrong[:3]
    assert [o.finish_reason for o in outcomes] == ["length"] * len(penalized) + ["stop"] * len(held) + \
        ["length"] * len(masked)
    assert served_by_d0 > 0 and front.metric("splitserve_migrations_total", outcome="migrated") >= 1
    wait_idle([p0, d1], 2.0)
