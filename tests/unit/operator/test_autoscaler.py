"""The operator's autoscaler (pool_scaling.py, scaling_task.py): spec → planner config, decision →
scale patches, status and Events, and one interval of the shared loop (services/autoscaling) end
to end against an in-memory apiserver (scale subresource, events, status)."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import replace

import pytest
from prometheus_client import REGISTRY

from splitserve.operator.builders import Owner
from splitserve.operator.events import EventRecorder
from splitserve.operator.kube import KubeError
from splitserve.operator.pool_scaling import (EVENT_REASON, FAILED_REASON, ScalePatch, autoscaling_status,
                                              capacity_profile, decision_key, planner_config, replica_counts,
                                              scale_patches)
from splitserve.operator.scaling_task import Autoscaler, AutoscaleTarget
from splitserve.services.spec.serving_deployment import ServingDeploymentSpec, SloAutoscalingSpec
from splitserve.operator.status import reconciler_owned
from splitserve.services.planner import MetricsSample, Planner, PlannerMode, ReplicaCounts
from splitserve.testing.waiting import async_wait_until

NS, NAME, UID = "team", "chat", "uid-1"
AUTOSCALING = {"enabled": True, "ttftP90Ms": 1000, "itlP90Ms": 100, "intervalSeconds": 1, "cooldownSeconds": 5,
               "maxWorkers": 6, "decode": {"minReplicas": 1, "maxReplicas": 4},
               "profile": {"prefillTokensPerSecond": 10000, "decodeTokensPerSecond": 100, "decodeBatchSize": 10,
                           "startupSeconds": 0}}
OWNER = Owner(NAME, NS, UID)
QUIET, BUSY = 1, 10          # arrivals per 1 s interval: decode needs 1 group, then 3 (20 output tokens each)


def spec(autoscaling=None) -> ServingDeploymentSpec:
    return ServingDeploymentSpec.from_dict({"model": {"source": "smollm2"},
                                            "autoscaling": AUTOSCALING if autoscaling is None else autoscaling})


def sample(t: float, arrivals: int, replicas: ReplicaCounts) -> MetricsSample:
    return MetricsSample(timestamp=t, interval_s=1.0, num_arrivals=arrivals, prompt_tokens_mean=100,
                         prompt_tokens_p90=100, output_tokens_mean=20, replicas=replicas, ttft_p90_s=0.2,
                         itl_p90_s=0.05)


def decide(arrivals: list[int], start: ReplicaCounts = ReplicaCounts.of_pools(1, 1)):
    """Run the planner of AUTOSCALING over one sample per second, applying each decision."""
    auto = spec().autoscaling
    planner = Planner(planner_config(auto), capacity_profile(auto.profile))
    history, counts, decisions = [], start, []
    for i, n in enumerate(arrivals):
        current = sample(float(i + 1), n, counts)
        decisions.append(planner.decide(history, current))
        history.append(current)
        counts = decisions[-1].replicas
    return decisions


# --- pure pieces ---------------------------------------------------------------------------

def test_planner_config_follows_the_spec():
    config = planner_config(spec().autoscaling)
    assert (config.slo.ttft_p90_s, config.slo.itl_p90_s) == (1.0, 0.1)
    assert config.mode is PlannerMode.DISAGGREGATED
    assert (config.prefill.min_replicas, config.prefill.max_replicas) == (1, 4)
    assert (config.decode.min_replicas, config.decode.max_replicas) == (1, 4)
    assert config.max_workers == 6 and config.cooldown_s == 5.0 and config.window_s == 60.0
    slow = planner_config(SloAutoscalingSpec.from_dict({**AUTOSCALING, "intervalSeconds": 45}))
    assert slow.window_s == 135.0            # at least three intervals in the predictor's window
    with pytest.raises(ValueError, match="ttftP90Ms and itlP90Ms are required"):
        planner_config(SloAutoscalingSpec())


def test_capacity_profile_is_one_point_per_curve():
    profile = capacity_profile(spec().autoscaling.profile)
    assert profile.prefill.at(50) == profile.prefill.at(8000) == 10000.0
    assert profile.token_seconds(10) == pytest.approx(0.1)    # decodeBatchSize / decodeTokensPerSecond
    assert profile.token_seconds(5) == pytest.approx(0.05)
    assert profile.startup_s == 0.0 and profile.kv_capacity_tokens is None


def test_a_step_up_patches_the_decode_pool_only():
    up = decide([QUIET, QUIET, BUSY])[-1]
    assert up.changed and up.replicas == ReplicaCounts.of_pools(1, 3)
    patches = scale_patches(NAME, up, {"prefill": 1, "decode": 1})
    assert patches == [ScalePatch("decode", "chat-decode", 1, 3)]
    assert patches[0].path(NS) == "/apis/splitserve.io/v1alpha1/namespaces/team/servingpools/chat-decode/scale"
    assert patches[0].body() == {"spec": {"replicas": 3}}
    assert patches[0].body("42") == {"spec": {"replicas": 3}, "metadata": {"resourceVersion": "42"}}


def test_no_patch_without_a_change_and_growing_pools_first():
    steady = decide([QUIET, QUIET])[-1]
    assert not steady.changed and scale_patches(NAME, steady, {"prefill": 1, "decode": 1}) == []
    both = replace(steady, replicas=ReplicaCounts.of_pools(3, 1))
    assert [(p.pool, p.current, p.replicas) for p in scale_patches(NAME, both, {"prefill": 1, "decode": 2})] == [
        ("prefill", 1, 3), ("decode", 2, 1)]
    # Aggregated is the prefill pool at 0: the decode pool grows before the prefill pool drains.
    joined = replace(steady, replicas=ReplicaCounts.of_aggregated(3))
    assert [(p.pool, p.current, p.replicas) for p in scale_patches(NAME, joined, {"prefill": 1, "decode": 1})] == [
        ("decode", 1, 3), ("prefill", 1, 0)]
    split = replace(steady, replicas=ReplicaCounts.of_pools(1, 2))
    assert [(p.pool, p.current, p.replicas) for p in scale_patches(NAME, split, {"prefill": 0, "decode": 3})] == [
        ("prefill", 0, 1), ("decode", 3, 2)]


def test_switch_modes_lets_the_planner_run_the_decode_groups_aggregated():
    auto = SloAutoscalingSpec.from_dict({**AUTOSCALING, "switchModes": True})
    config = planner_config(auto)
    assert config.mode is PlannerMode.AUTO and config.aggregated == config.decode
    assert SloAutoscalingSpec.from_dict(auto.to_dict()) == auto
    assert replica_counts(0, 3, switch_modes=True) == ReplicaCounts.of_aggregated(3)
    # Without switchModes a prefill pool at 0 is a disaggregated deployment short of its minimum.
    assert replica_counts(0, 3, switch_modes=False) == ReplicaCounts.of_pools(0, 3)
    assert replica_counts(2, 3, switch_modes=True) == ReplicaCounts.of_pools(2, 3)
    # A quiet load: one aggregated group does what a prefill and a decode group do; the planner
    # switches once the cool-down is over, and the patches take the prefill pool to 0.
    planner = Planner(config, capacity_profile(auto.profile))
    history, counts, switch = [], ReplicaCounts.of_pools(1, 1), None
    for t in range(1, 12):
        decision = planner.decide(history, sample(float(t), QUIET, counts))
        history.append(decision.inputs)
        counts = decision.replicas
        if switch is None and not counts.disaggregated:
            switch = decision
    assert switch is not None and switch.timestamp >= AUTOSCALING["cooldownSeconds"], switch
    assert switch.replicas == ReplicaCounts.of_aggregated(1)
    assert [(p.pool, p.replicas) for p in scale_patches(NAME, switch, {"prefill": 1, "decode": 1})] == [("prefill", 0)]
    assert autoscaling_status(switch, "now", None)["mode"] == "aggregated"


def test_quiet_after_the_cooldown_patches_the_decode_pool_down():
    decisions = decide([QUIET, QUIET, BUSY, BUSY, QUIET, QUIET, QUIET, QUIET, QUIET, QUIET, QUIET, QUIET])
    counts = [d.replicas.num_decode for d in decisions]
    assert counts[2] == 3
    down = next(i for i, c in enumerate(counts) if i > 2 and c < 3)
    assert down - 2 >= 5                        # not before the cool-down (5 s) since the change
    assert {d.pool("decode").binding.value for d in decisions[4:down]} <= {"cooldown", "hold", "itl"}
    patch = scale_patches(NAME, decisions[down], {"prefill": 1, "decode": 3})
    assert patch == [ScalePatch("decode", "chat-decode", 3, 1)]


def test_status_names_the_counts_and_binding_constraints():
    up = decide([QUIET, QUIET, BUSY])[-1]
    status = autoscaling_status(up, "T1", "T0")
    assert status["replicas"] == "1P+3D" and status["changed"] is True and status["mode"] == "disaggregated"
    assert status["binding"] == "prefill: utilisation, decode: itl"
    assert status["decode"] == {"current": 1, "needed": 3, "chosen": 3, "binding": "itl", "reachable": True}
    assert status["prefill"]["chosen"] == 1
    assert status["observed"] == {"arrivalRate": 10.0, "ttftP90Ms": 200.0, "itlP90Ms": 50.0}
    assert status["predicted"]["decodeTokensPerSecond"] == 200.0
    assert status["lastDecisionTime"] == "T1" and status["lastScaleTime"] == "T0"
    assert status["message"] == up.explain()
    assert "lastScaleTime" not in autoscaling_status(up, "T1", None)


def test_decision_key_groups_repeats():
    d = decide([QUIET, QUIET, QUIET, BUSY, BUSY])
    assert decision_key(d[1]) == decision_key(d[2]) != decision_key(d[3])
    assert decision_key(d[3]) != decision_key(d[4])       # 1->3 (a change) vs 3 held


def test_reconciler_leaves_status_autoscaling_alone():
    status = {"observedGeneration": 3, "decode": {}, "autoscaling": {"replicas": "1P+3D"}}
    assert reconciler_owned(status) == {"observedGeneration": 3, "decode": {}}


# --- one interval against an in-memory apiserver -------------------------------------------

class FakeKube:
    """The calls the autoscaler makes: ServingPools (with their scale subresource), the
    ServingDeployment's status, Events. `on_scale_read` runs after each Scale GET (races)."""

    def __init__(self, prefill: int = 1, decode: int = 1):
        base = "/apis/splitserve.io/v1alpha1/namespaces/team"
        self.pool_base = f"{base}/servingpools"
        self.sd_status = f"{base}/servingdeployments/{NAME}/status"
        self.pools = {f"{NAME}-prefill": [prefill, 1], f"{NAME}-decode": [decode, 1]}   # replicas, rv
        self.status: dict = {}
        self.events: dict[str, dict] = {}
        self.scale_patches: list[tuple[str, dict]] = []
        self.on_scale_read = lambda name: None

    async def get(self, path):
        name = path.removeprefix(self.pool_base + "/").removesuffix("/scale")
        if name not in self.pools:
            return None
        replicas, rv = self.pools[name]
        self.on_scale_read(name)
        return {"kind": "Scale", "metadata": {"name": name, "resourceVersion": str(rv)},
                "spec": {"replicas": replicas}}

    def scale(self, name: str, replicas: int) -> None:
        self.pools[name] = [replicas, self.pools[name][1] + 1]

    async def merge_patch(self, path, patch):
        if path == self.sd_status:
            for key, value in patch["status"].items():
                if value is None:
                    self.status.pop(key, None)
                else:
                    self.status[key] = copy.deepcopy(value)
            return {}
        if path.endswith("/scale"):
            name = path.removeprefix(self.pool_base + "/").removesuffix("/scale")
            rv = patch.get("metadata", {}).get("resourceVersion")
            if rv is not None and rv != str(self.pools[name][1]):
                raise KubeError(409, "PATCH", path, "the object has been modified")
            self.scale(name, patch["spec"]["replicas"])
            self.scale_patches.append((name, patch))
            return {}
        if "/events/" in path:
            self.events[path.rsplit("/", 1)[1]].update(patch)
            return {}
        raise AssertionError(f"unexpected patch of {path}")

    async def create(self, path, body):
        assert path.endswith("/events"), path
        name = f"{NAME}.{len(self.events)}"
        self.events[name] = {**body, "metadata": {**body["metadata"], "name": name}}
        return self.events[name]

    def by_reason(self, reason):
        return [e for e in self.events.values() if e["reason"] == reason]


class ScriptedSource:
    """A stand-in MetricsSource: one sample per call from a list of arrivals, at t = 1, 2, ..."""

    def __init__(self, arrivals):
        self.arrivals = list(arrivals)
        self.t = 0.0
        self.forgotten = []

    async def sample(self, target: AutoscaleTarget, replicas: ReplicaCounts):
        assert target.owner.name == NAME
        self.t += 1.0
        return sample(self.t, self.arrivals.pop(0), replicas) if self.arrivals else None

    def forget(self, uid):
        self.forgotten.append(uid)


def sd_body(autoscaling=None, status=None) -> dict:
    return {"metadata": {"name": NAME, "namespace": NS, "uid": UID},
            "spec": {"model": {"source": "smollm2"}, "autoscaling": AUTOSCALING if autoscaling is None
                     else autoscaling},
            "status": status or {}}


def make(kube, source, bodies):
    scaled = []

    async def deployments():
        return bodies

    clock = [0.0]
    autoscaler = Autoscaler(kube, EventRecorder(kube), source, deployments, on_scaled=lambda: scaled.append(1),
                            clock=lambda: clock[0])
    return autoscaler, scaled, clock


def run(coro):
    return asyncio.run(coro)


def test_an_interval_applies_the_decision_through_the_scale_subresource_and_records_it():
    kube, source = FakeKube(), ScriptedSource([QUIET, BUSY, BUSY])
    autoscaler, scaled, _ = make(kube, source, [])
    state = autoscaler.scaling(OWNER, spec()).loop

    quiet = run(state.interval())
    assert not quiet.changed and kube.scale_patches == [] and not scaled
    [event] = kube.by_reason(EVENT_REASON)
    assert event["message"] == quiet.explain() and event["type"] == "Normal"
    assert event["involvedObject"] == {"apiVersion": "splitserve.io/v1alpha1", "kind": "ServingDeployment",
                                       "name": NAME, "namespace": NS, "uid": UID}
    assert kube.status["autoscaling"]["replicas"] == "1P+1D"

    up = run(state.interval())
    assert up.replicas == ReplicaCounts.of_pools(1, 3)
    # Through the scale subresource, conditional on the resourceVersion read just before.
    assert kube.scale_patches == [("chat-decode", {"spec": {"replicas": 3}, "metadata": {"resourceVersion": "1"}})]
    assert kube.pools["chat-decode"][0] == 3 and kube.pools["chat-prefill"][0] == 1
    assert scaled == [1]
    events = kube.by_reason(EVENT_REASON)
    assert len(events) == 2 and events[1]["message"] == up.explain() and "1P+1D -> 1P+3D" in events[1]["message"]
    status = kube.status["autoscaling"]
    assert status["replicas"] == "1P+3D" and status["decode"]["binding"] == "itl" and "lastScaleTime" in status
    # ... and the metrics `splitserve operator --metrics-port` serves.
    sample = REGISTRY.get_sample_value
    assert sample("splitserve_planner_replicas", {"deployment": f"{NS}/{NAME}", "pool": "decode"}) == 3
    assert sample("splitserve_planner_binding", {"deployment": f"{NS}/{NAME}", "pool": "decode", "binding": "itl"}) == 1

    held = run(state.interval())                             # reads 3 back from the ServingPool
    assert held.current == ReplicaCounts.of_pools(1, 3) and not held.changed
    assert len(state.history) == 3 and autoscaler.num_decisions == 3


def test_repeated_decisions_bump_one_event():
    kube, source = FakeKube(), ScriptedSource([QUIET] * 4)
    autoscaler, _, _ = make(kube, source, [])
    state = autoscaler.scaling(OWNER, spec()).loop
    decisions = [run(state.interval()) for _ in range(4)]
    [event] = kube.by_reason(EVENT_REASON)
    assert event["count"] == 4 and event["message"] == decisions[-1].explain()


def test_a_user_scaling_in_between_wins():
    kube, source = FakeKube(), ScriptedSource([BUSY])
    autoscaler, scaled, _ = make(kube, source, [])
    reads = []

    def user_scales(name):
        reads.append(name)
        if name == "chat-decode" and reads.count(name) == 2:     # between the decision and its patch
            kube.scale(name, 2)

    kube.on_scale_read = user_scales
    decision = run(autoscaler.scaling(OWNER, spec()).loop.interval())
    assert decision.replicas.num_decode == 3
    assert kube.scale_patches == [] and kube.pools["chat-decode"][0] == 2 and not scaled
    [failed] = kube.by_reason(FAILED_REASON)
    assert failed["type"] == "Warning"
    assert failed["message"] == "decode pool not scaled 1 -> 3: ServingPool chat-decode was scaled to 2 meanwhile"


def test_a_conflict_on_the_resource_version_is_retried():
    kube, source = FakeKube(), ScriptedSource([BUSY])
    autoscaler, scaled, _ = make(kube, source, [])
    reads = []

    def status_write(name):          # the reconciler writes the ServingPool's status: a new resourceVersion
        reads.append(name)
        if name == "chat-decode" and reads.count(name) == 2:
            kube.pools[name][1] += 1

    kube.on_scale_read = status_write
    original = kube.merge_patch
    bumped = []

    async def merge_patch(path, patch):
        if path.endswith("/scale") and not bumped:
            bumped.append(1)
            kube.pools["chat-decode"][1] += 1
        return await original(path, patch)

    kube.merge_patch = merge_patch
    run(autoscaler.scaling(OWNER, spec()).loop.interval())
    assert kube.pools["chat-decode"][0] == 3 and scaled == [1] and not kube.by_reason(FAILED_REASON)


def test_run_due_takes_a_baseline_then_decides_each_interval():
    kube, source = FakeKube(), ScriptedSource([QUIET, QUIET, BUSY])
    autoscaler, scaled, clock = make(kube, source, [sd_body()])
    run(autoscaler.run_due())                       # baseline: no decision yet
    assert autoscaler.num_decisions == 0 and UID in autoscaler.states
    run(autoscaler.run_due())                       # not due yet (interval 1 s)
    assert autoscaler.num_decisions == 0
    clock[0] = 1.0
    run(autoscaler.run_due())
    clock[0] = 2.0
    run(autoscaler.run_due())
    assert autoscaler.num_decisions == 2 and kube.pools["chat-decode"][0] == 3 and scaled == [1]


def test_run_due_forgets_and_clears_status_when_autoscaling_goes_off():
    kube, source = FakeKube(), ScriptedSource([QUIET] * 3)
    bodies = [sd_body()]
    autoscaler, _, clock = make(kube, source, bodies)
    run(autoscaler.run_due())
    clock[0] = 1.0
    run(autoscaler.run_due())
    assert "autoscaling" in kube.status
    bodies[0] = sd_body({"enabled": False}, status={"autoscaling": kube.status["autoscaling"]})
    run(autoscaler.run_due())
    assert "autoscaling" not in kube.status and autoscaler.states == {} and source.forgotten == [UID]


def test_run_due_skips_invalid_specs_and_deployments_being_deleted():
    kube, source = FakeKube(), ScriptedSource([QUIET] * 3)
    bad = sd_body({"enabled": True})                       # no targets: the reconciler reports it
    gone = sd_body()
    gone["metadata"] = {**gone["metadata"], "uid": "uid-2", "deletionTimestamp": "2026-01-01T00:00:00Z"}
    autoscaler, _, _ = make(kube, source, [bad, gone])
    run(autoscaler.run_due())
    assert autoscaler.states == {} and source.arrivals == [QUIET] * 3


def test_a_spec_change_keeps_the_history_and_the_refined_profile():
    autoscaler, _, _ = make(FakeKube(), ScriptedSource([]), [])
    scaling = autoscaler.scaling(OWNER, spec())
    state = scaling.loop
    state.history.extend(sample(float(t), QUIET, ReplicaCounts.of_pools(1, 1)) for t in (1, 2))
    history, profile = list(state.history), state.planner.profile
    wider = {**AUTOSCALING, "decode": {"minReplicas": 1, "maxReplicas": 5}}
    again = autoscaler.scaling(OWNER, spec(wider)).loop
    assert again is state and list(again.history) == history
    assert again.planner.config.decode.max_replicas == 5 and again.planner.profile is profile
    faster = {**AUTOSCALING, "profile": {**AUTOSCALING["profile"], "decodeTokensPerSecond": 200}}
    assert autoscaler.scaling(OWNER, spec(faster)).loop.planner.profile.decode.at(10) == 200.0
    assert scaling.pools.switch_modes is False
    assert autoscaler.scaling(OWNER, spec({**AUTOSCALING, "switchModes": True})).pools.switch_modes is True


def test_a_refused_interval_is_a_warning_event_not_a_crash():
    kube, source = FakeKube(), ScriptedSource([QUIET] * 4)
    autoscaler, _, clock = make(kube, source, [sd_body()])
    run(autoscaler.run_due())                               # baseline

    async def forbidden(path):
        raise KubeError(403, "GET", path, 'servingpools.splitserve.io "chat-decode" is forbidden')

    kube.get = forbidden
    for t in (1.0, 2.0):
        clock[0] = t
        run(autoscaler.run_due())
    [failed] = kube.by_reason(FAILED_REASON)
    assert failed["type"] == "Warning" and "HTTP 403" in failed["message"] and failed["count"] == 2
    assert autoscaler.num_decisions == 0 and UID in autoscaler.states


def test_operator_loop_runs_the_autoscaler_beside_its_passes():
    from splitserve.operator.loop import OperatorLoop
    from splitserve.operator.metrics_source import PodMetricsSource

    class EmptyCluster:
        def __init__(self):
            self.paths = []

        async def list(self, path, label_selector=None, field_selector=None):
            self.paths.append(path)
            return []

        async def get(self, path):
            return None

    async def scenario():
        kube = EmptyCluster()
        loop = OperatorLoop(kube, [NS], ["etcd:2379"], interval_s=0.05, min_interval_s=0.01)
        assert isinstance(loop.autoscaler.source, PodMetricsSource)     # the live scrape by default
        task = asyncio.create_task(loop.run())

        def num_sd_lists() -> int:
            return sum(p.endswith("/namespaces/team/servingdeployments") for p in kube.paths)

        await async_wait_until(lambda: loop.num_passes >= 1 and num_sd_lists() > loop.num_passes, timeout=5,
                               interval=0.01, what="a pass and a look of the autoscaler")
        loop.stop()
        await asyncio.wait_for(task, 5)
        assert task.done() and loop.num_passes >= 1
        assert num_sd_lists() > loop.num_passes                  # the autoscaler looked too

    asyncio.run(scenario())
