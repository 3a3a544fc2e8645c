"""KeyLimiter (concurrency + token bucket) with a stepped clock, LimitsConfig checks, PromptBound."""

from __future__ import annotations

import math

import pytest

from splitserve.services.frontend.errors import APIError
from splitserve.services.frontend.limits import (KeyLimiter, LimitsConfig, PromptBound, Rejection,
                                                 check_prompt_tokens)
from splitserve.testing.clock import FakeClock


def test_concurrency_is_per_client_and_slots_come_back():
    limiter = KeyLimiter(LimitsConfig(max_concurrent_per_key=2))
    assert limiter.admit("a") is None and limiter.admit("a") is None
    refusal = limiter.admit("a")
    assert refusal.reason is Rejection.CONCURRENCY and refusal.retry_after_s == 1
    assert limiter.admit("b") is None                  # another client has its own slots
    limiter.finish("a")
    assert limiter.admit("a") is None
    for client in ("a", "a", "b"):
        limiter.finish(client)
    assert limiter.num_in_flight() == 0               # leak check
    limiter.finish("a")                               # an extra finish never goes negative
    assert limiter.num_in_flight() == 0


def test_rate_limit_token_bucket_and_retry_after():
    clock = FakeClock(100.0)
    limiter = KeyLimiter(LimitsConfig(rate_limit=0.5, rate_limit_burst=2, max_concurrent_per_key=0), clock)
    assert limiter.admit("k") is None and limiter.admit("k") is None     # the burst
    refusal = limiter.admit("k")
    assert refusal.reason is Rejection.RATE_LIMIT and refusal.retry_after_s == 2   # 1 token at 0.5/s
    clock.now += 1.0
    assert limiter.admit("k").retry_after_s == 1
    clock.now += 1.0
    assert limiter.admit("k") is None
    clock.now += 1000.0                               # refills up to the burst, never beyond
    assert [limiter.admit("k") is None for _ in range(3)] == [True, True, False]


def test_concurrency_refusal_costs_no_rate_token():
    clock = FakeClock(100.0)
    limiter = KeyLimiter(LimitsConfig(rate_limit=1.0, rate_limit_burst=2, max_concurrent_per_key=1), clock)
    assert limiter.admit("k") is None
    assert limiter.admit("k").reason is Rejection.CONCURRENCY
    limiter.finish("k")
    assert limiter.admit("k") is None                 # the second token was still there


def test_default_burst_and_validation():
    assert LimitsConfig(rate_limit=0.2).burst == 1
    assert LimitsConfig(rate_limit=7.5).burst == 8
    LimitsConfig().validate()
    for bad in (dict(max_body_bytes=-1), dict(rate_limit=math.nan), dict(request_timeout_s=math.inf),
                dict(max_concurrent_per_key=-3)):
        with pytest.raises(ValueError, match="--"):
            LimitsConfig(**bad).validate()


def test_prompt_token_limit_and_bound():
    check_prompt_tokens(16, 16, "prompt")
    check_prompt_tokens(10**6, 0, "prompt")           # 0: no limit here (the context check remains)
    with pytest.raises(APIError) as info:
        check_prompt_tokens(17, 16, "messages")
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    assert info.value.param == "messages"
    bound = PromptBound(max_token_chars=5)
    bound.check(80, 16, "prompt")                     # 16 tokens of 5 characters can spell 80
    with pytest.raises(APIError, match="81 characters"):
        bound.check(81, 16, "prompt")
    bound.check(10**9, None, "prompt")                # no context known yet: no bound
