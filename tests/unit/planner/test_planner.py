"""Planner.decide on scripted series: the pool that binds grows, quiet shrinks after the
cool-down, bounds hold, start-up time pulls scale-up forward, every decision says why."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

from splitserve.services.planner import Binding, Planner, PlannerMode, PoolBounds, ReplicaCounts

from .conftest import INTERVAL_S, Load, counts, make_config, make_profile, replay, sample_of, steady

SPLIT_1_1 = ReplicaCounts.of_pools(1, 1)


def _planner(**overrides) -> Planner:
    return Planner(make_config(mode=PlannerMode.DISAGGREGATED, **overrides), make_profile())


def test_a_step_in_long_prompts_grows_the_prefill_pool_at_once():
    loads = steady(300, 0.5, 2048, 32) + steady(200, 6.0, 2048, 32)
    decisions = replay(_planner(), loads, SPLIT_1_1)
    before, step = decisions[29], decisions[30]
    assert before.replicas == SPLIT_1_1
    assert step.replicas.num_prefill > 1                     # the first interval after the step
    assert step.pool("prefill").binding in (Binding.TTFT, Binding.UTILISATION)
    assert set(counts(decisions, "decode")) == {1}           # 192 output tok/s: one decode worker is plenty
    assert counts(decisions, "prefill")[-1] == 3             # 12k prompt tok/s, ~5k per worker within the TTFT
    assert "prefill 1->" in step.explain() and step.fields()["prefill_binding"] == step.pool("prefill").binding.value


def test_a_step_in_long_outputs_grows_the_decode_pool_at_once():
    loads = steady(300, 0.5, 64, 1024) + steady(200, 3.0, 64, 1024)
    decisions = replay(_planner(), loads, SPLIT_1_1)
    assert decisions[29].replicas == SPLIT_1_1
    step = decisions[30]
    assert step.replicas.num_decode > 1 and step.pool("decode").binding is Binding.ITL
    assert set(counts(decisions, "prefill")) == {1}
    # 3 req/s * 1024 tokens over ~1060 tok/s per worker at the ITL target, with 20 % headroom: 4 workers.
    assert counts(decisions, "decode")[-1] == 4
    assert step.load.decode_tokens_per_s > step.load.prefill_tokens_per_s


def test_a_quiet_period_shrinks_the_pool_only_after_the_cool_down():
    cooldown_s = 300.0
    loads = steady(200, 6.0, 2048, 32) + steady(900, 0.2, 2048, 32)
    decisions = replay(_planner(cooldown_s=cooldown_s), loads, SPLIT_1_1)
    prefill = counts(decisions, "prefill")
    peak = max(prefill)
    assert peak >= 3
    quiet_from = 200.0
    last_rise = max(d.timestamp for d in decisions if d.replicas.num_prefill > d.current.num_prefill)
    first_fall = next(d for d in decisions if d.replicas.num_prefill < d.current.num_prefill)
    # Not before the cool-down after the last change, nor while the window still holds busy samples.
    assert first_fall.timestamp >= last_rise + cooldown_s
    assert first_fall.timestamp >= quiet_from + cooldown_s
    held = [d for d in decisions if quiet_from < d.timestamp < first_fall.timestamp]
    assert held and all(d.pool("prefill").binding in (Binding.COOLDOWN, Binding.HOLD) for d in held)
    assert prefill[-1] == 1                                  # and it does shrink, to what the quiet load needs


def test_pool_bounds_and_max_workers_are_respected_and_named():
    heavy = steady(100, 40.0, 4096, 1024)
    decisions = replay(_planner(prefill=PoolBounds(1, 3), decode=PoolBounds(2, 6), max_workers=16), heavy, SPLIT_1_1)
    for d in decisions:
        assert 1 <= d.replicas.num_prefill <= 3 and 2 <= d.replicas.num_decode <= 6
    assert decisions[-1].bindings == ("prefill: bound: max", "decode: bound: max")
    capped = replay(_planner(max_workers=5), heavy, SPLIT_1_1)
    assert all(d.replicas.total <= 5 for d in capped)
    assert Binding.MAX_WORKERS in {p.binding for p in capped[-1].pools}
    assert "bound: max_workers" in capped[-1].explain()
    idle = replay(_planner(decode=PoolBounds(2, 6)), steady(50, 0.0, 0, 0), SPLIT_1_1)
    assert idle[0].replicas == ReplicaCounts.of_pools(1, 2) and idle[0].pool("decode").binding is Binding.MIN


def test_startup_time_brings_scale_up_forward():
    ramp = [Load(round(INTERVAL_S * 0.5 * 2 ** (i * INTERVAL_S / 40)), 2048, 32) for i in range(20)]

    def run(startup_s: float) -> list[int]:
        planner = Planner(make_config(mode=PlannerMode.DISAGGREGATED), make_profile(startup_s=startup_s))
        return counts(replay(planner, ramp, SPLIT_1_1), "prefill")

    slow, instant = run(90.0), run(0.0)
    assert all(a >= b for a, b in zip(slow, instant))
    assert any(a > b for a, b in zip(slow, instant))
    first_rise = {name: next(i for i, c in enumerate(series) if c > 1)
                  for name, series in (("slow", slow), ("instant", instant))}
    assert first_rise["slow"] < first_rise["instant"]


def test_the_prediction_reaches_ahead_by_the_startup_time():
    ramp = [Load(round(INTERVAL_S * 0.5 * 2 ** (i * INTERVAL_S / 40)), 2048, 32) for i in range(8)]
    decision = replay(_planner(), ramp, SPLIT_1_1)[-1]
    assert decision.load.horizon_s == 60.0 and decision.load.trend_per_s > 0
    assert decision.load.arrival_rate > decision.inputs.arrival_rate
    assert "trend" in decision.explain()


def test_an_observed_slo_miss_adds_a_worker_once_the_last_one_had_time_to_start():
    profile = make_profile(startup_s=30.0)
    planner = Planner(make_config(mode=PlannerMode.DISAGGREGATED), profile)
    fine, missed = Load(5, 512, 32), Load(5, 512, 32, ttft_p90_s=2.5)
    decisions = replay(planner, [fine] * 3 + [missed] * 7, SPLIT_1_1)
    assert decisions[2].replicas == SPLIT_1_1
    # Missed at t=40, but the samples cover only 30 s: the last change may be younger than start-up + one interval.
    assert decisions[3].replicas == SPLIT_1_1
    bump = decisions[4]
    assert bump.pool("prefill").needed == 1                              # the model thinks one is enough
    assert bump.replicas.num_prefill == 2 and bump.pool("prefill").binding is Binding.OBSERVED_SLO
    # The new worker shows from t=60 on; no third one until t=100 (start-up + one interval later).
    assert [d.replicas.num_prefill for d in decisions[5:]] == [2, 2, 2, 2, 3]
    assert {d.replicas.num_decode for d in decisions} == {1}


def test_auto_mode_starts_aggregated_for_light_load_and_switches_only_after_the_cool_down():
    planner = Planner(make_config(mode=PlannerMode.AUTO, cooldown_s=120.0), make_profile())
    light = steady(300, 0.5, 256, 64)
    cold = planner.decide([], sample_of(INTERVAL_S, light[0], ReplicaCounts()))
    assert cold.replicas == ReplicaCounts.of_aggregated(1) and "start aggregated" in cold.mode_reason
    decisions = replay(planner, light, SPLIT_1_1)
    switch = next(i for i, d in enumerate(decisions) if not d.replicas.disaggregated)
    assert decisions[switch].timestamp >= 120.0 and "switch from disaggregated" in decisions[switch].mode_reason
    assert all(d.replicas == SPLIT_1_1 and "cool-down" in d.mode_reason for d in decisions[:switch - 1])
    assert decisions[switch].pools[0].pool == "aggregated" and decisions[-1].replicas == ReplicaCounts.of_aggregated(1)


def test_a_mode_that_needs_more_than_max_workers_is_left_without_waiting_out_a_count_change():
    # 6 req/s of long outputs: disaggregated needs 9 workers, aggregated 8; at most 3 run. The
    # start's cool-down held 1P+2D for 120 s although every interval in it missed the SLO.
    planner = Planner(make_config(mode=PlannerMode.AUTO, cooldown_s=120.0, max_workers=3), make_profile())
    outputs, prompts = steady(60, 6.0, 64, 1024), steady(300, 12.0, 2048, 32)
    decisions = replay(planner, outputs + prompts, SPLIT_1_1)
    first = decisions[0]
    assert first.replicas == ReplicaCounts.of_aggregated(3) and "switch from disaggregated" in first.mode_reason
    # Then long prompts: aggregated needs 7, disaggregated 6, but the cool-down after a switch
    # still holds, so the modes cannot flap.
    switches = [d for d in decisions if d.replicas.disaggregated != d.current.disaggregated]
    assert len(switches) == 2 and switches[1].replicas.disaggregated
    assert switches[1].timestamp - switches[0].timestamp >= 120.0
    assert all("cool-down" in d.mode_reason for d in decisions if 0 < d.timestamp - first.timestamp < 120.0)


def test_a_decision_explains_inputs_load_counts_and_binding():
    planner = _planner()
    loads = steady(60, 3.0, 2048, 256)
    decision = replay(planner, loads, SPLIT_1_1)[-1]
    line = decision.explain()
    for part in (f"{decision.current.describe()} ->", "prefill", "decode", "req/s", "prompt 2048", "output 256", "observed ttft p90 0.4 s",
                 decision.pools[0].binding.value):
        assert part in line, (part, line)
    fields = decision.fields()
    assert fields["num_prefill"] == decision.replicas.num_prefill and fields["mode"] == "disaggregated"
    assert fields["prefill_binding"] == decision.pool("prefill").binding.value
    assert fields["predicted_arrival_rate"] == decision.load.arrival_rate == 3.0
    assert all(isinstance(v, (str, bool, int, float)) for v in fields.values())


def test_history_out_of_order_is_refused():
    planner = _planner()
    a, b = (sample_of(t, Load(10, 512, 64), SPLIT_1_1) for t in (20.0, 10.0))
    try:
        planner.decide([a], b)
    except ValueError as e:
        assert "increasing" in str(e)
    else:
        raise AssertionError("decide accepted a history newer than its current sample")


def test_bounds_below_the_current_count_apply_at_once():
    planner = _planner(prefill=PoolBounds(1, 2))
    decision = planner.decide([], sample_of(10.0, Load(0, 0, 0), ReplicaCounts.of_pools(5, 1)))
    assert decision.replicas.num_prefill == 2 and decision.pool("prefill").binding is Binding.MAX
    assert replace(decision.current, num_prefill=2) == decision.replicas


def test_the_planner_imports_no_torch_kubernetes_or_network_code():
    code = ("import sys, splitserve.services.planner; "
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    loaded = set(result.stdout.split())
    assert "splitserve" in loaded
    assert not loaded & {"torch", "numpy", "kubernetes", "kopf", "grpc", "httpx", "socket", "asyncio"}, loaded


def test_max_workers_cannot_trade_a_worker_back_and_forth_between_two_wanting_pools():
    cooldown_s = 60.0
    prompts, outputs = Load(60, 2048, 32), Load(30, 64, 1024)     # prefill wants 3, then decode wants 4
    loads = ([prompts, prompts, outputs, outputs] * 15)
    planner = _planner(max_workers=4, cooldown_s=cooldown_s)
    decisions = replay(planner, loads, ReplicaCounts.of_pools(2, 2))
    assert all(d.replicas.total <= 4 for d in decisions)
    changes = [d.timestamp for d in decisions if d.changed]
    assert len(changes) >= 2                                       # it does follow the mix ...
    assert all(b - a >= cooldown_s for a, b in zip(changes, changes[1:]))   # ... a cool-down apart at most
    assert any(Binding.MAX_WORKERS in {p.binding for p in d.pools} for d in decisions)
