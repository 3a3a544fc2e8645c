"""When a prefix the shared store holds is fetched rather than recomputed (kv_tiers/shared_store.py)."""

from __future__ import annotations

import pytest

from splitserve.services.engine.kv_tiers.shared_store import FetchRule


def test_it_fetches_until_the_prefill_speed_is_known():
    rule = FetchRule(block_size=16, rtt_s=10.0)              # a fetch slower than anything
    assert rule.should_fetch(4) and not rule.should_fetch(0)
    rule.observe_prefill(16, 1.0)                            # too few tokens to say anything
    assert rule.prefill_tokens_per_s is None


def test_a_slow_cpu_prefill_fetches_and_a_fast_gpu_prefill_recomputes():
    # Measured on the 2-core EPYC: SmolLM2 prefill ~270 tokens/s, a fetch ~1 ms a block plus 0.5 ms.
    cpu = FetchRule(block_size=16, rtt_s=5e-4, block_fetch_s=1e-3)
    cpu.observe_prefill(512, 512 / 270)
    assert cpu.should_fetch(1) and cpu.recompute_s(1) == pytest.approx(16 / 270)
    # A GPU that prefills 200k tokens/s recomputes a 16-token block in 80 µs: cheaper than the trip.
    gpu = FetchRule(block_size=16, rtt_s=5e-4, block_fetch_s=1e-3)
    gpu.observe_prefill(8192, 8192 / 200_000)
    assert not gpu.should_fetch(1) and not gpu.should_fetch(64)


def test_observations_move_the_estimates_by_a_fifth():
    rule = FetchRule(block_size=16, rtt_s=1e-3, block_fetch_s=1e-3)
    rule.observe_fetch(10, 1e-3 + 10 * 3e-3)                 # 3 ms a block after the round trip
    assert rule.block_fetch_s == pytest.approx(1e-3 + 0.2 * 2e-3)
    rule.observe_prefill(100, 1.0)
    rule.observe_prefill(100, 0.5)
    assert rule.prefill_tokens_per_s == pytest.approx(100 + 0.2 * 100)
    assert rule.fetch_s(2) == pytest.approx(rule.rtt_s + 2 * rule.block_fetch_s)
