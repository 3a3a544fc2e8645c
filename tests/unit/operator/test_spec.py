"""ServingDeploymentSpec: defaults, round trip, and the errors a bad spec gets."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from splitserve.operator import names
from splitserve.services.spec.serving_deployment import (DEFAULT_VLLM_IMAGE, DTYPES, ENGINES, ROUTER_POLICIES,
                                                         WORKER_POD_PORTS, GatewaySpec, PoolSpec,
                                                         ServingDeploymentSpec)

CRD = Path(__file__).resolve().parents[3] / "deploy/helm/splitserve/crds/servingdeployments.splitserve.io.yaml"

FULL = {
    "image": "example/splitserve:1",
    "model": {"source": "/models/qwen", "dtype": "float16", "revision": "qwen-2026-11"},
    "frontend": {"replicas": 2, "serviceType": "NodePort", "port": 9000},
    "router": {"policy": "power-of-two", "prefillWeight": 0.5, "temperature": 0.1},
    "prefill": {"replicas": 3, "tensorParallel": 2, "pipelineParallel": 2, "gpusPerRank": 1,
                "resources": {"cpu": "8", "memory": "32Gi"},
                "topology": {"mode": "same-label", "labelKey": "topology.kubernetes.io/zone"},
                "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "targetOngoingRequests": 16.0}},
    "decode": {"replicas": 0, "topology": {"mode": "none"}},
    "disaggregationThreshold": 128, "migrationLimit": 1, "drainTimeoutSeconds": 30,
    "gateway": {"enabled": True, "port": 8080},
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
    ({"model": {"source": "x", "revision": ""}}, "spec.model.revision: expected a non-empty string"),
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
    ({"decode": {"workerArgs": ["--port", "1"]}}, "spec.decode.workerArgs: --port is set by the operator"),
    ({"decode": {"engineArgs": ["--engine", "vllm"]}}, "spec.decode.engineArgs: --engine is set by the operator "
                                                       "from the engine field"),
    ({"engine": "sglang"}, "spec.engine: 'sglang' is not one of builtin, vllm"),
    ({"tracing": {"otlpTracesEndpoint": "collector:4317"}}, "spec.tracing.otlpTracesEndpoint: an OTLP/gRPC "
                                                            "collector URL such as http://"),
    ({"tracing": {"otlpTracesEndpoint": ""}}, "spec.tracing.otlpTracesEndpoint: expected a non-empty string"),
    ({"tracing": {"endpoint": "http://c:4317"}}, "spec.tracing: unknown field(s) endpoint; known: otlpTracesEndpoint"),
    ({"prefill": {"replicas": 0}, "decode": {"engine": "tgi"}}, "spec.decode.engine: 'tgi' is not one of"),
    # vLLM flags the operator sets, in either spelling vLLM's parser reads
    *[({"engine": "vllm", "prefill": {"replicas": 0}, "decode": {"engineArgs": args}},
       f"spec.decode.engineArgs: {flag} is set by the operator from {where}")
      for args, flag, where in [(["--tensor-parallel-size", "2"], "--tensor-parallel-size", "the pool's tensorParallel"),
                                (["--tensor_parallel_size=2"], "--tensor-parallel-size", "the pool's tensorParallel"),
                                (["-tp", "2"], "-tp", "the pool's tensorParallel"),
                                (["-pp", "2"], "-pp", "the pool's pipelineParallel"),
                                (["--model", "/m"], "--model", "spec.model.source"),
                                (["--port=9"], "--port", "the pod"), (["--host", "x"], "--host", "the pod")]],
    ({"engine": "vllm", "prefill": {"replicas": 0}, "decode": {"engineArgs": ["--dtype", "half", "--", "-tp"]}},
     "spec.decode.engineArgs: a bare -- is not allowed"),
    # a prefill pool sends KV only to decode workers of its own engine
    ({"decode": {"engine": "vllm"}}, "spec.prefill.engine: the prefill pool runs builtin and the decode pool vllm"),
    ({"prefill": {"replicas": 0, "autoscaling": {"minReplicas": 0, "maxReplicas": 2}}, "decode": {"engine": "vllm"}},
     "their KV layouts differ, so no prompt could be sent from one to the other"),
    ({"kvConnector": "nixl-vllm"}, "spec.kvConnector: nixl-vllm is vLLM's own connector and needs engine vllm"),
    ({"engine": "vllm", "kvConnector": "lmcache"}, "spec.kvConnector: 'lmcache' is not one of splitserve, nixl-vllm"),
    ({"gateway": {"enabled": True, "port": 50051}}, "spec.gateway.port: 50051 is a port of the worker container"),
    ({"gateway": {"port": 8090}}, "spec.gateway.port: 8090 is a port of the worker container"),
    ({"gateway": {"port": 70000}}, "spec.gateway.port: must be <= 65535, got 70000"),
    ({"gateway": {"enabled": "yes"}}, "spec.gateway.enabled: expected a boolean"),
    ({"gateway": {"targetPort": 8000}}, "spec.gateway: unknown field(s) targetPort; known: enabled, port"),
])
def test_bad_specs_name_the_field(patch, message):
    doc = {"model": {"source": "smollm2"}, **patch}
    if doc.get("model") is None:
        doc.pop("model")
    with pytest.raises(ValueError, match=None) as err:
        ServingDeploymentSpec.from_dict(doc)
    assert message in str(err.value)


def test_engine_vllm_spec_round_trips_with_its_flags_where_the_engine_takes_them():
    doc = {"model": {"source": "/models/qwen3-moe", "dtype": "bfloat16"}, "engine": "vllm",
           "prefill": {"replicas": 0},
           "decode": {"replicas": 2, "tensorParallel": 4, "gpusPerRank": 1,
                      "workerArgs": ["--kv-cache-gib", "8"],
                      "engineArgs": ["--quantization", "fp8", "--max_model_len=8192", "--enable-lora"]}}
    spec = ServingDeploymentSpec.from_dict(doc)
    assert (spec.engine, spec.decode.engine, spec.prefill.engine) == ("vllm", "vllm", "vllm")
    assert spec.vllm_image == DEFAULT_VLLM_IMAGE and spec.worker_image("decode") == DEFAULT_VLLM_IMAGE
    assert spec.decode.worker_args == ("--kv-cache-gib", "8")
    assert spec.decode.engine_args == ("--quantization", "fp8", "--max_model_len=8192", "--enable-lora")
    # vLLM spawns its own ranks: one pod per group, holding all four GPUs
    assert (spec.decode.group_size, spec.decode.gpus_per_pod, spec.decode.gpus_per_group) == (1, 4, 4)
    assert ServingDeploymentSpec.from_dict(spec.to_dict()) == spec
    # A pool's own engine wins over the deployment's, and is written back only where it differs.
    mixed = ServingDeploymentSpec.from_dict({**doc, "engine": "builtin", "decode": {**doc["decode"], "engine": "vllm"}})
    assert (mixed.prefill.engine, mixed.decode.engine) == ("builtin", "vllm")
    assert mixed.worker_image("prefill") == mixed.image
    assert "engine" not in mixed.to_dict()["prefill"] and mixed.to_dict()["decode"]["engine"] == "vllm"
    assert ServingDeploymentSpec.from_dict(mixed.to_dict()) == mixed


def test_builtin_pools_keep_engine_args_as_worker_flags_and_their_document():
    """Manifests written before `engine` existed mean what they meant: engineArgs are
    `splitserve worker` flags, and the pool's document (its spec hash) has no new key."""
    doc = {"model": {"source": "smollm2"}, "decode": {"engineArgs": ["--kv-cache-gib", "4"]}}
    spec = ServingDeploymentSpec.from_dict(doc)
    assert spec.engine == "builtin" and spec.decode.engine_args == ("--kv-cache-gib", "4")
    assert spec.decode.group_size == 1 and spec.decode.gpus_per_pod == 1
    assert set(spec.decode.to_dict()) == {"replicas", "tensorParallel", "pipelineParallel", "gpusPerRank",
                                          "resources", "topology", "engineArgs"}
    wide = ServingDeploymentSpec.from_dict({**doc, "decode": {"tensorParallel": 4}})
    assert (wide.decode.group_size, wide.decode.gpus_per_pod) == (4, 1)


def test_tracing_is_off_unless_an_endpoint_is_given_and_round_trips():
    plain = ServingDeploymentSpec.from_dict({"model": {"source": "smollm2"}})
    assert plain.tracing.otlp_traces_endpoint is None and plain.to_dict()["tracing"] == {}
    traced = ServingDeploymentSpec.from_dict({"model": {"source": "smollm2"},
                                              "tracing": {"otlpTracesEndpoint": "http://otel.obs:4317"}})
    assert traced.tracing.otlp_traces_endpoint == "http://otel.obs:4317"
    assert ServingDeploymentSpec.from_dict(traced.to_dict()) == traced
    assert ServingDeploymentSpec.from_dict(plain.to_dict()) == plain


def test_gateway_is_off_by_default_and_round_trips():
    plain = ServingDeploymentSpec.from_dict({"model": {"source": "smollm2"}})
    assert plain.gateway == GatewaySpec(enabled=False, port=8000)
    assert plain.to_dict()["gateway"] == {"enabled": False, "port": 8000}
    full = ServingDeploymentSpec.from_dict(FULL)
    assert full.gateway == GatewaySpec(enabled=True, port=8080)
    assert ServingDeploymentSpec.from_dict(full.to_dict()) == full


def test_the_ports_a_gateway_frontend_may_not_take_are_the_worker_containers():
    assert sorted(WORKER_POD_PORTS) == sorted((names.WORKER_PORT, names.WORKER_SESSION_PORT, names.DIST_PORT,
                                               names.WORKER_METRICS_PORT))


def test_crd_schema_agrees_with_the_dataclasses():
    crd = yaml.safe_load(CRD.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    props = schema["properties"]
    assert set(props) == set(ServingDeploymentSpec._FIELDS)
    assert schema["required"] == ["model"]
    assert tuple(props["router"]["properties"]["policy"]["enum"]) == ROUTER_POLICIES
    assert tuple(props["model"]["properties"]["dtype"]["enum"]) == DTYPES
    assert set(props["model"]["properties"]) == {"source", "dtype", "revision"}
    assert tuple(props["engine"]["enum"]) == ENGINES and props["engine"]["default"] == "builtin"
    assert tuple(props["prefill"]["properties"]["engine"]["enum"]) == ENGINES
    assert "default" not in props["prefill"]["properties"]["engine"]      # absent: the deployment's engine
    assert props["vllmImage"]["default"] == DEFAULT_VLLM_IMAGE
    assert props["decode"] == props["prefill"]
    pool = props["prefill"]["properties"]
    assert set(pool) == set(PoolSpec._FIELDS)
    assert pool["replicas"]["minimum"] == 0 and pool["tensorParallel"]["minimum"] == 1
    # The schema's defaults are the dataclasses' defaults.
    defaults = ServingDeploymentSpec.from_dict({"model": {"source": "m"}}).to_dict()
    for key in ("replicas", "tensorParallel", "pipelineParallel", "gpusPerRank"):
        assert pool[key]["default"] == defaults["prefill"][key]
    assert props["drainTimeoutSeconds"]["default"] == defaults["drainTimeoutSeconds"]
    assert set(props["tracing"]["properties"]) == {"otlpTracesEndpoint"}
    gateway = props["gateway"]
    assert {k: v["default"] for k, v in gateway["properties"].items()} == GatewaySpec().to_dict()
    assert (gateway["properties"]["port"]["minimum"], gateway["properties"]["port"]["maximum"]) == (1, 65535)
    [rule] = gateway["x-kubernetes-validations"]
    assert f"self.port in {list(WORKER_POD_PORTS)}".replace(" ", "") in rule["rule"].replace(" ", "")
