"""spec.autoscaling (the SLO planner's targets and bounds): defaults, round trip, errors, CRD schema."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from splitserve.services.spec.serving_deployment import (CapacityProfileSpec, PoolBoundsSpec, ServingDeploymentSpec,
                                      SloAutoscalingSpec)

CRD = Path(__file__).resolve().parents[3] / "deploy/helm/splitserve/crds/servingdeployments.splitserve.io.yaml"

ENABLED = {"enabled": True, "ttftP90Ms": 800, "itlP90Ms": 50}


def parse(autoscaling):
    return ServingDeploymentSpec.from_dict({"model": {"source": "smollm2"}, "autoscaling": autoscaling}).autoscaling


def test_absent_is_off_with_the_documented_defaults():
    spec = ServingDeploymentSpec.from_dict({"model": {"source": "smollm2"}}).autoscaling
    assert spec == SloAutoscalingSpec()
    assert not spec.enabled and spec.ttft_p90_ms is None and spec.itl_p90_ms is None
    assert (spec.interval_s, spec.cooldown_s, spec.max_workers) == (30, 300, None)
    assert spec.prefill == spec.decode == PoolBoundsSpec(1, 4)
    assert spec.worker_limit == 8          # without maxWorkers: the pools' maxima together
    assert spec.profile == CapacityProfileSpec()


def test_enabled_spec_parses_and_round_trips():
    doc = {**ENABLED, "intervalSeconds": 10, "cooldownSeconds": 120, "maxWorkers": 6,
           "prefill": {"minReplicas": 1, "maxReplicas": 2}, "decode": {"minReplicas": 2, "maxReplicas": 5},
           "profile": {"prefillTokensPerSecond": 12000, "decodeTokensPerSecond": 900.5, "decodeBatchSize": 16,
                       "startupSeconds": 45, "kvCapacityTokens": 200000}}
    spec = parse(doc)
    assert spec.enabled and spec.ttft_p90_ms == 800.0 and spec.itl_p90_ms == 50.0
    assert (spec.interval_s, spec.cooldown_s, spec.max_workers, spec.worker_limit) == (10, 120, 6, 6)
    assert spec.bounds("prefill") == PoolBoundsSpec(1, 2) and spec.bounds("decode") == PoolBoundsSpec(2, 5)
    assert spec.profile == CapacityProfileSpec(12000.0, 900.5, 16, 45.0, 200000)
    whole = ServingDeploymentSpec.from_dict({"model": {"source": "smollm2"}, "autoscaling": doc})
    assert ServingDeploymentSpec.from_dict(whole.to_dict()) == whole
    assert whole.to_dict()["autoscaling"]["maxWorkers"] == 6
    off = ServingDeploymentSpec.from_dict({"model": {"source": "smollm2"}})
    assert ServingDeploymentSpec.from_dict(off.to_dict()) == off
    assert off.to_dict()["autoscaling"]["enabled"] is False


def test_a_lone_min_replicas_raises_the_default_max_with_it():
    assert parse({**ENABLED, "decode": {"minReplicas": 6}}).decode == PoolBoundsSpec(6, 6)


def test_targets_may_be_set_while_off():
    spec = parse({"ttftP90Ms": 500, "itlP90Ms": 40})
    assert not spec.enabled and spec.ttft_p90_ms == 500.0


@pytest.mark.parametrize("doc, message", [
    ({"enabled": True}, "spec.autoscaling.ttftP90Ms: required when autoscaling is enabled"),
    ({"enabled": True, "ttftP90Ms": 500}, "spec.autoscaling.itlP90Ms: required when autoscaling is enabled"),
    ({**ENABLED, "ttftP90Ms": 0}, "spec.autoscaling.ttftP90Ms: must be > 0, got 0"),
    ({**ENABLED, "itlP90Ms": -5}, "spec.autoscaling.itlP90Ms: must be > 0, got -5"),
    ({**ENABLED, "itlP90Ms": "fast"}, "spec.autoscaling.itlP90Ms: expected a number"),
    ({"enabled": "yes"}, "spec.autoscaling.enabled: expected a boolean"),
    ({**ENABLED, "intervalSeconds": 0}, "spec.autoscaling.intervalSeconds: must be >= 1, got 0"),
    ({**ENABLED, "intervalSeconds": 2.5}, "spec.autoscaling.intervalSeconds: expected an integer"),
    ({**ENABLED, "cooldownSeconds": -1}, "spec.autoscaling.cooldownSeconds: must be >= 0, got -1"),
    ({**ENABLED, "prefill": {"minReplicas": 0}}, "spec.autoscaling.prefill.minReplicas: must be >= 1, got 0"),
    ({**ENABLED, "decode": {"minReplicas": 3, "maxReplicas": 2}},
     "spec.autoscaling.decode: maxReplicas (2) must be >= minReplicas (3)"),
    ({**ENABLED, "decode": {"replicas": 3}}, "spec.autoscaling.decode: unknown field(s) replicas"),
    ({**ENABLED, "maxWorkers": 1}, "spec.autoscaling.maxWorkers: must be >= 2, got 1"),
    ({**ENABLED, "maxWorkers": 3, "prefill": {"minReplicas": 2}, "decode": {"minReplicas": 2}},
     "spec.autoscaling.maxWorkers: must be >= prefill.minReplicas + decode.minReplicas (4), got 3"),
    ({**ENABLED, "profile": {"decodeTokensPerSecond": 0}},
     "spec.autoscaling.profile.decodeTokensPerSecond: must be > 0, got 0"),
    ({**ENABLED, "profile": {"decodeBatchSize": 0}}, "spec.autoscaling.profile.decodeBatchSize: must be >= 1"),
    ({**ENABLED, "profile": {"startupSeconds": -1}}, "spec.autoscaling.profile.startupSeconds: must be >= 0"),
    ({**ENABLED, "profile": {"kvCapacityTokens": 0}}, "spec.autoscaling.profile.kvCapacityTokens: must be >= 1"),
    ({**ENABLED, "minReplicas": 1}, "spec.autoscaling: unknown field(s) minReplicas"),
    ("on", "spec.autoscaling: expected an object"),
])
def test_bad_autoscaling_names_the_field(doc, message):
    with pytest.raises(ValueError) as err:
        parse(doc)
    assert message in str(err.value)


def _autoscaling_schema():
    crd = yaml.safe_load(CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["autoscaling"]


def test_crd_schema_agrees_with_the_dataclass():
    schema = _autoscaling_schema()
    props = schema["properties"]
    assert tuple(props) == SloAutoscalingSpec._FIELDS
    assert tuple(props["profile"]["properties"]) == CapacityProfileSpec._FIELDS
    assert props["prefill"] == props["decode"]
    assert set(props["prefill"]["properties"]) == {"minReplicas", "maxReplicas"}
    assert props["prefill"]["properties"]["minReplicas"]["minimum"] == 1
    assert props["intervalSeconds"]["minimum"] == 1 and props["cooldownSeconds"]["minimum"] == 0
    assert props["maxWorkers"]["minimum"] == 2
    for target in ("ttftP90Ms", "itlP90Ms"):
        assert props[target]["exclusiveMinimum"] is True and props[target]["minimum"] == 0
    # The schema's defaults are the dataclass's (the apiserver fills them in before the operator reads).
    defaults = SloAutoscalingSpec().to_dict()
    for key in ("enabled", "switchModes", "intervalSeconds", "cooldownSeconds"):
        assert props[key]["default"] == defaults[key], key
    for key, value in CapacityProfileSpec().to_dict().items():
        assert props["profile"]["properties"][key]["default"] == value, key
    # The CEL rules cover what from_dict checks across fields.
    rules = " ".join(r["message"] for r in schema["x-kubernetes-validations"])
    assert "required when autoscaling is enabled" in rules and "maxWorkers must be >=" in rules
