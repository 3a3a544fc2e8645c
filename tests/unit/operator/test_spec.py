"""ServingDeploymentSpec: defaults, round trip, and the errors a bad spec gets."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from splitserve.services.spec.serving_deployment import DTYPES, ROUTER_POLICIES, ServingDeploymentSpec

CRD = Path(__file__).resolve().parents[3] / "deploy/helm/splitserve/crds/servingdeployments.splitserve.io.yaml"

FULL = {
    "image": "example/splitserve:1",
    "model": {"source": "/models/qwen", "dtype": "float16"},
    "frontend": {"replicas": 2, "serviceType": "NodePort", "port": 9000},
    "router": {"policy": "power-of-two", "prefillWeight": 0.5, "temperature": 0.1},
    "prefill": {"replicas": 3, "tensorParallel": 2, "pipelineParallel": 2, "gpusPerRank": 1,
                "resources": {"cpu": "8", "memory": "32Gi"},
                "topology": {"mode": "same-label", "labelKey": "topology.kubernetes.io/zone"},
                "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "targetOngoingRequests": 16.0}},
    "decode": {"replicas": 0, "topology": {"mode": "none"}},
    "disaggregationThreshold": 128, "migrationLimit": 1, "drainTimeoutSeconds": 30,
}


def test_defaults_fill_a_minimal_spec():
    spec = ServingDeploymentSpec.from_dict({"model": {"source": "smollm2"}})
    assert spec.model.dtype == "bfloat16"
    assert spec.frontend.replicas == 1 and spec.frontend.port == 8000
    assert spec.router.policy == "kv"
    assert spec.prefill.replicas == 1 and spec.decode.group_size == 1
    assert spec.decode.topology.mode == "same-node"
    assert spec.drain_timeout_seconds == 300


def test_full_spec_round_trips():
    spec = ServingDeploymentSpec.from_dict(FULL)
    assert spec.prefill.group_size == 4 and spec.prefill.gpus_per_group == 4
    assert spec.prefill.topology.label_key == "topology.kubernetes.io/zone"
    assert spec.prefill.autoscaling.max_replicas == 4
    assert ServingDeploymentSpec.from_dict(spec.to_dict()) == spec
    assert spec.to_dict()["prefill"]["resources"] == {"cpu": "8", "memory": "32Gi"}


@pytest.mark.parametrize("patch, message", [
    ({"model": None}, "spec.model: required"),
    ({"model": {"dtype": "float16"}}, "spec.model.source: required"),
    ({"model": {"source": "x", "dtype": "int4"}}, "spec.model.dtype: 'int4' is not one of"),
    ({"router": {"policy": "fastest"}}, "spec.router.policy: 'fastest' is not one of"),
    ({"decode": {"replicas": -1}}, "spec.decode.replicas: must be >= 0, got -1"),
    ({"prefill": {"tensorParallel": 0}}, "spec.prefill.tensorParallel: must be >= 1"),
    ({"prefill": {"replicas": "two"}}, "spec.prefill.replicas: expected an integer"),
    ({"prefill": {"topology": {"mode": "same-label"}}}, "spec.prefill.topology.labelKey: required"),
    ({"prefill": {"topology": {"mode": "same-node", "labelKey": "zone"}}}, "only allowed with mode same-label"),
    ({"prefill": {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}}, "maxReplicas (2) must be >= minReplicas"),
    ({"frontend": {"port": 70000}}, "spec.frontend.port: must be <= 65535"),
    ({"replicas": 3}, "spec: unknown field(s) replicas"),
    ({"decode": {"engineArgs": ["--tp", "2"]}}, "spec.decode.engineArgs: --tp is set by the operator"),
    ({"decode": {"engineArgs": ["--etcd=x:1"]}}, "spec.decode.engineArgs: --etcd is set by the operator"),
    ({"decode": {"engineArgs": "--threads 2"}}, "spec.decode.engineArgs: expected a list of non-empty strings"),
])
def test_bad_specs_name_the_field(patch, message):
    doc = {"model": {"source": "smollm2"}, **patch}
    if doc.get("model") is None:
        doc.pop("model")
    with pytest.raises(ValueError, match=None) as err:
        ServingDeploymentSpec.from_dict(doc)
    assert message in str(err.value)


def test_crd_schema_agrees_with_the_dataclasses():
    crd = yaml.safe_load(CRD.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    props = schema["properties"]
    assert set(props) == set(ServingDeploymentSpec._FIELDS)
    assert schema["required"] == ["model"]
    assert tuple(props["router"]["properties"]["policy"]["enum"]) == ROUTER_POLICIES
    assert tuple(props["model"]["properties"]["dtype"]["enum"]) == DTYPES
    assert props["decode"] == props["prefill"]
    pool = props["prefill"]["properties"]
    assert pool["replicas"]["minimum"] == 0 and pool["tensorParallel"]["minimum"] == 1
    # The schema's defaults are the dataclasses' defaults.
    defaults = ServingDeploymentSpec.from_dict({"model": {"source": "m"}}).to_dict()
    for key in ("replicas", "tensorParallel", "pipelineParallel", "gpusPerRank"):
        assert pool[key]["default"] == defaults["prefill"][key]
    assert props["drainTimeoutSeconds"]["default"] == defaults["drainTimeoutSeconds"]
