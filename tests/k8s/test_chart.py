"""The Helm chart deploy/helm/splitserve with the real helm binary and apiserver.

- `helm lint --strict` is clean, with default values and with every option on;
- `helm template` output is valid against the Kubernetes 1.37 schemas
  (kubernetes-validate, strict: unknown fields are errors). Objects of custom
  kinds have no schema there and are routed: ServingDeployment to the real
  apiserver (server-side dry run against the chart's CRD), ServiceMonitor and
  PodMonitor (third-party CRDs, not installed here) to a structural check;
- the dashboard only queries worker metrics that `splitserve worker --metrics-port`
  exports, on the port the PodMonitor scrapes and the workers' NetworkPolicy opens;
- values.schema.json rejects bad values, and helm says which field;
- `helm install` into the real control plane creates every rendered object,
  the operator's ServiceAccount has exactly the RBAC it needs, and
  `helm uninstall` removes them again;
- the gateway switch (`gateway.enabled`, issue 40): off, nothing of it renders; on, the
  InferencePool, the endpoint picker's Deployment, Service and RBAC, the HTTPRoute, and GIE's
  vendored InferencePool CRD (`gateway.installCRDs`, checked byte for byte against v1.6.0's);
  installed with the CRD, the apiserver takes the InferencePool (defaults filled in by the
  CRD) and refuses invalid ones, and the EPP's ServiceAccount may read pods and pools only.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from cluster import wait_until
from controlplane import KubeCluster

from splitserve.operator import builders, names
from splitserve.services.cli.parsers import build_parser
from splitserve.services.epp.objectives import ObjectiveBook, ObjectiveWatch
from splitserve.services.spec.serving_deployment import ServingDeploymentSpec
from splitserve.services.worker.stats_metrics import COUNTERS, GAUGES, TIER_COUNTERS, TIER_DROPPED, TIER_GAUGES
from splitserve.testing.waiting import async_wait_until

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "splitserve"
CRD_FILE = CHART / "crds" / "servingdeployments.splitserve.io.yaml"
K8S_SCHEMA_VERSION = "1.37.0"      # kubernetes-validate's schemas for the cluster's minor
KUBE_VERSION = "v1.37.2"           # what build-control-plane.sh builds
CUSTOM_KINDS = {"ServingDeployment", "ServiceMonitor", "PodMonitor", "InferencePool", "HTTPRoute", "InferenceObjective"}
# GIE v1.6.0's config/crd/bases/inference.networking.k8s.io_inferencepools.yaml, vendored unchanged
# (charts/gie-crds/README.md): its git blob id at tag v1.6.0 (commit 992e5c29...).
GIE_CRD_FILE = CHART / "charts" / "gie-crds" / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
GIE_CRD_BLOB = "99b47edc6726e4ad5a8ec6b91287a1c2acb54246"
# GIE v1.5.0's InferenceObjective CRD (v1.6.0 dropped the API; llm-d keeps it), vendored unchanged.
OBJECTIVE_CRD_FILE = GIE_CRD_FILE.parent / "inference.networking.x-k8s.io_inferenceobjectives.yaml"
OBJECTIVE_CRD_BLOB = "e765a9ced8053eafb429042a0a2b17c6e33e9b26"
OBJECTIVE_CRD_NAME = "inferenceobjectives.inference.networking.x-k8s.io"
GIE_CRD_NAME = "inferencepools.inference.networking.k8s.io"
GIE_VERSION = "v1.6.0"
MONITOR_APIS = ("--api-versions", "monitoring.coreos.com/v1/ServiceMonitor",
                "--api-versions", "monitoring.coreos.com/v1/PodMonitor")

ALL_OPTIONS = {
    "commonLabels": {"team": "inference"},
    "image": {"repository": "registry.example/splitserve", "tag": "0.1.0-test", "vllmTag": "0.1.0-test-vllm-cpu",
              "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "operator": {"replicas": 2, "watchNamespaces": ["team-a", "team-b"], "logLevel": "debug",
                 "extraArgs": ["--verbose"], "extraEnv": [{"name": "EXTRA", "value": "1"}],
                 "nodeSelector": {"node-role": "system"},
                 "tolerations": [{"key": "system", "operator": "Exists", "effect": "NoSchedule"}],
                 "podAnnotations": {"example.com/note": "x"},
                 "serviceAccount": {"annotations": {"example.com/role": "operator"}}},
    "etcd": {"persistence": {"enabled": True, "size": "2Gi", "storageClass": "fast"},
             "tls": {"enabled": True, "serverSecretName": "etcd-server", "clientSecretName": "etcd-client"}},
    "networkPolicy": {"frontendFrom": [{"namespaceSelector": {"matchLabels": {"ingress": "true"}}}],
                      "workerPeerPorts": [29500, 40000]},
    "monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    "tls": {"enabled": True, "secretName": "splitserve-tls"},
    "sample": {"enabled": True, "name": "demo"},
    "kvStore": {"enabled": True, "capacityGiB": 2, "transfer": "tcp", "nodeSelector": {"memory": "large"}},
    "gateway": {"enabled": True, "deployment": "demo", "poolName": "demo-pool", "targetPort": 8080,
                "failureMode": "FailOpen", "model": "smollm2", "installCRDs": True,
                "epp": {"replicas": 2, "extraArgs": ["--log-level", "debug"], "nodeSelector": {"node-role": "system"},
                        "tolerations": [{"key": "system", "operator": "Exists", "effect": "NoSchedule"}]},
                "httpRoute": {"enabled": True, "parentRefs": [{"name": "inference-gateway", "namespace": "gw",
                                                               "sectionName": "http"}],
                              "hostnames": ["llm.example.com"], "pathPrefix": "/v1", "requestTimeout": "10m"}},
}
ALL_OPTIONS["networkPolicy"]["gatewayFrom"] = [{"namespaceSelector": {"matchLabels": {"gateway": "true"}}}]


def _helm_template(bin_dir: Path, tmp_path: Path, values: dict | None = None, *extra: str,
                   check: bool = True) -> subprocess.CompletedProcess:
    argv = [str(bin_dir / "helm"), "template", "rel", str(CHART), "--namespace", "splitserve",
            "--include-crds", "--kube-version", KUBE_VERSION, *extra]
    if values is not None:
        path = tmp_path / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        argv += ["-f", str(path)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                          env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    if check and proc.returncode != 0:
        raise AssertionError(f"helm template failed:\n{proc.stderr}")
    return proc


def _documents(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def _validate_all(docs: list[dict]) -> list[dict]:
    """Validate built-in kinds strictly; return the custom-kind objects for routing."""
    routed = []
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            routed.append(doc)
            continue
        try:
            kubernetes_validate.validate(doc, K8S_SCHEMA_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']}: {e.message} at "
                                 f"{'.'.join(str(p) for p in e.path)}") from e
    return routed


def _summary(docs: list[dict]) -> list[str]:
    return sorted(f"{d['kind']}/{d['metadata'].get('namespace', '-')}/{d['metadata']['name']}" for d in docs)


def test_lint_is_clean_with_default_and_all_options(k8s_bin_dir: Path, tmp_path: Path):
    helm = str(k8s_bin_dir / "helm")
    values = tmp_path / "all.yaml"
    values.write_text(yaml.safe_dump(ALL_OPTIONS))
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    for extra in ([], ["-f", str(values)]):
        proc = subprocess.run([helm, "lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION, *extra],
                              capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout
        assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


def test_default_render_is_valid_kubernetes(k8s_bin_dir: Path, tmp_path: Path):
    docs = _documents(_helm_template(k8s_bin_dir, tmp_path).stdout)
    routed = _validate_all(docs)
    assert routed == []
    kinds = sorted(d["kind"] for d in docs)
    print("\n".join(_summary(docs)))
    assert kinds.count("NetworkPolicy") == 4
    assert {"CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
            "RoleBinding", "Deployment", "StatefulSet", "Service", "ConfigMap"} <= set(kinds)
    # Standard labels everywhere; never user labels in selectors.
    for d in docs:
        if d["kind"] == "CustomResourceDefinition":
            continue
        labels = d["metadata"]["labels"]
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by",
                    "app.kubernetes.io/version", "app.kubernetes.io/component", "helm.sh/chart"):
            assert key in labels, (d["kind"], d["metadata"]["name"], key)
    dashboard = next(d for d in docs if d["kind"] == "ConfigMap")
    panels = {p["title"] for p in json.loads(dashboard["data"]["splitserve.json"])["panels"]}
    assert {"Time to first token", "Inter-token latency", "End-to-end request latency", "Requests by status",
            "KV cache usage", "KV transfer bytes", "KV write fences", "KV tiers (host, disk, store)"} <= panels


def test_all_options_render_is_valid_kubernetes(k8s_bin_dir: Path, tmp_path: Path, kube_cluster: KubeCluster,
                                                k8s_namespace: str):
    proc = _helm_template(k8s_bin_dir, tmp_path, ALL_OPTIONS, *MONITOR_APIS)
    docs = _documents(proc.stdout)
    routed = _validate_all(docs)
    print("\n".join(_summary(docs)))
    assert sorted(d["kind"] for d in routed) == ["HTTPRoute", "InferencePool", "PodMonitor", "ServiceMonitor",
                                                 "ServingDeployment"]
    # Roles per watched namespace instead of a cluster-wide workload ClusterRole.
    roles = {(d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs if d["kind"] == "Role"}
    assert {ns for ns, _ in roles} == {"team-a", "team-b", "splitserve"}
    operator = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-operator"))
    pod = operator["spec"]["template"]["spec"]
    assert pod["volumes"][-1] == {"name": "tls", "secret": {"secretName": "splitserve-tls"}}
    monitor = next(d for d in routed if d["kind"] == "ServiceMonitor")
    assert monitor["spec"]["selector"] == {"matchLabels": {"splitserve.io/role": "frontend"}}
    assert monitor["spec"]["endpoints"][0]["port"] == "http"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    # The sample ServingDeployment is checked by the real apiserver against the chart's CRD.
    sample = next(d for d in routed if d["kind"] == "ServingDeployment")
    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    kube_cluster.kubectl("wait", "--for=condition=Established", "--timeout=30s",
                         "crd/servingdeployments.splitserve.io")
    sample["metadata"]["namespace"] = k8s_namespace
    kube_cluster.kubectl("create", "--dry-run=server", "-o", "name", "-f", "-", input=yaml.safe_dump(sample))


VLLM_SAMPLE = {"model": {"source": "/models/qwen", "dtype": "float32"}, "engine": "vllm",
               "prefill": {"replicas": 0},
               "decode": {"replicas": 2, "tensorParallel": 2, "gpusPerRank": 1,
                          "workerArgs": ["--kv-cache-gib", "8"],
                          "engineArgs": ["--quantization", "fp8", "--max-model-len", "8192"]}}


def test_an_engine_vllm_sample_renders_and_its_worker_pods_are_valid(k8s_bin_dir: Path, tmp_path: Path,
                                                                       kube_cluster: KubeCluster, k8s_namespace: str):
    """`engine: vllm` through the chart: the sample gets the image's vLLM flavour, the apiserver
    takes it against the CRD (with a vLLM prefill pool too, not with a built-in one), and the
    worker pods the operator builds from it are valid Kubernetes."""
    values = {"image": {"repository": "registry.example/splitserve", "tag": "0.1.0-test"},
              "sample": {"enabled": True, "name": "vllm", "spec": VLLM_SAMPLE}}
    docs = _documents(_helm_template(k8s_bin_dir, tmp_path, values).stdout)
    [sample] = _validate_all(docs)
    assert sample["spec"]["vllmImage"] == "registry.example/splitserve:0.1.0-test-vllm"
    assert sample["spec"]["image"] == "registry.example/splitserve:0.1.0-test"
    cpu = {**values, "image": {**values["image"], "vllmTag": "0.1.0-vllm-cpu"}}
    [cpu_sample] = _validate_all(_documents(_helm_template(k8s_bin_dir, tmp_path, cpu).stdout))
    assert cpu_sample["spec"]["vllmImage"] == "registry.example/splitserve:0.1.0-vllm-cpu"
    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    kube_cluster.kubectl("wait", "--for=condition=Established", "--timeout=30s",
                         "crd/servingdeployments.splitserve.io")
    sample["metadata"]["namespace"] = k8s_namespace
    created = kube_cluster.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-",
                                   input=yaml.safe_dump(sample))
    spec = ServingDeploymentSpec.from_resource(json.loads(created.stdout))    # with the apiserver's defaults
    owner = builders.Owner("vllm", k8s_namespace, "uid-1")
    [pod] = builders.build_group_pods(owner, spec, "decode", "vllm-decode-abc12")
    kubernetes_validate.validate(pod, K8S_SCHEMA_VERSION, strict=True)
    container = pod["spec"]["containers"][0]
    assert container["image"] == "registry.example/splitserve:0.1.0-test-vllm"
    assert container["args"][container["args"].index("--"):] == [
        "--", "--quantization", "fp8", "--max-model-len", "8192", "--tensor-parallel-size", "2"]
    # With a vLLM prefill pool (and vLLM's own connector) it is taken; a built-in prefill pool,
    # which could never send this decode pool a prompt's KV, is refused.
    disaggregated = {**sample, "spec": {**sample["spec"], "prefill": {"replicas": 1}, "kvConnector": "nixl-vllm"}}
    created = kube_cluster.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-",
                                   input=yaml.safe_dump(disaggregated))
    spec = ServingDeploymentSpec.from_resource(json.loads(created.stdout))
    [prefill_pod] = builders.build_group_pods(owner, spec, "prefill", "vllm-prefill-abc12")
    kubernetes_validate.validate(prefill_pod, K8S_SCHEMA_VERSION, strict=True)
    args = prefill_pod["spec"]["containers"][0]["args"]
    assert args[:7] == ["worker", "--engine", "vllm", "--kv-connector", "nixl-vllm", "--role", "prefill"]
    mixed = {**sample, "spec": {**sample["spec"], "prefill": {"replicas": 1, "engine": "builtin"}}}
    refused = kube_cluster.kubectl("create", "--dry-run=server", "-o", "name", "-f", "-",
                                   input=yaml.safe_dump(mixed), check=False)
    assert refused.returncode != 0 and "the prefill and decode pools run different engines" in refused.stderr


def test_kv_store_is_a_statefulset_workers_reach_and_that_reaches_them(k8s_bin_dir: Path, tmp_path: Path):
    docs = _documents(_helm_template(k8s_bin_dir, tmp_path, {"kvStore": {"enabled": True, "capacityGiB": 2}}).stdout)
    assert _validate_all(docs) == []
    store = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "rel-splitserve-kvstore")
    container = store["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["splitserve", "kvstore"]
    assert "--capacity-gib=2" in container["args"] and "--advertise-host=$(POD_IP)" in container["args"]
    assert container["readinessProbe"]["grpc"]["port"] == 50070
    assert {"name": "metrics", "containerPort": 8090} in container["ports"]
    assert store["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "8090"
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "rel-splitserve-kvstore")
    assert service["spec"]["ports"][0]["port"] == 50070
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    assert len(policies) == 5
    store_from = policies["rel-splitserve-kvstore"]["ingress"][0]["from"]
    assert store_from[0]["podSelector"]["matchExpressions"][0]["values"] == ["prefill", "decode"]
    worker_peers = policies["rel-splitserve-workers"]["ingress"][1]["from"]
    assert {"podSelector": {"matchLabels": {"splitserve.io/role": "kvstore"}}} in worker_peers
    # Off by default: nothing of it renders.
    default = _documents(_helm_template(k8s_bin_dir, tmp_path).stdout)
    assert not [d for d in default if "kvstore" in d["metadata"]["name"]]


def test_external_etcd_replaces_the_statefulset(k8s_bin_dir: Path, tmp_path: Path):
    endpoints = ["https://etcd-0.example:2379", "https://etcd-1.example:2379"]
    docs = _documents(_helm_template(k8s_bin_dir, tmp_path, {"etcd": {"external": {"endpoints": endpoints}}}).stdout)
    assert _validate_all(docs) == []
    assert "StatefulSet" not in {d["kind"] for d in docs}
    assert not [d for d in docs if d["metadata"]["name"].endswith("-etcd")]
    operator = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SPLITSERVE_ETCD"] == ",".join(endpoints)


def test_etcd_tls_serves_https_with_client_certificates(k8s_bin_dir: Path, tmp_path: Path):
    values = {"etcd": {"tls": {"enabled": True, "serverSecretName": "etcd-server", "clientSecretName": "etcd-client"}}}
    docs = _documents(_helm_template(k8s_bin_dir, tmp_path, values).stdout)
    assert _validate_all(docs) == []
    etcd = next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    args = etcd["containers"][0]["args"]
    assert "--client-cert-auth" in args and "--trusted-ca-file=/etc/etcd/tls/ca.crt" in args
    assert next(a for a in args if a.startswith("--listen-client-urls=")).startswith("--listen-client-urls=https://")
    assert {"name": "tls", "secret": {"secretName": "etcd-server"}} in etcd["volumes"]
    probe = etcd["containers"][0]["readinessProbe"]["httpGet"]
    assert probe["port"] == "metrics"                  # plain HTTP: probes have no client certificate
    operator = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SPLITSERVE_ETCD"].startswith("https://") and env["SPLITSERVE_ETCD_TLS_SECRET"] == "etcd-client"
    for missing in ("serverSecretName", "clientSecretName"):
        broken = {"etcd": {"tls": {**values["etcd"]["tls"], missing: ""}}}
        proc = _helm_template(k8s_bin_dir, tmp_path, broken, check=False)
        assert proc.returncode != 0 and f"etcd.tls.{missing} must be set" in proc.stderr


def test_monitors_need_their_api(k8s_bin_dir: Path, tmp_path: Path):
    docs = _documents(_helm_template(k8s_bin_dir, tmp_path, {"monitoring": {"serviceMonitor": {"enabled": True}}}).stdout)
    assert not {"ServiceMonitor", "PodMonitor"} & {d["kind"] for d in docs}
    docs = _documents(_helm_template(k8s_bin_dir, tmp_path, None, *MONITOR_APIS).stdout)
    assert not {"ServiceMonitor", "PodMonitor"} & {d["kind"] for d in docs}     # off by default


def _worker_pod() -> dict:
    spec = ServingDeploymentSpec.from_dict({"model": {"source": "smollm2"}})
    return builders.build_worker_pod(builders.Owner("llm", "splitserve", "uid"), spec, "decode", "llm-decode-1", 0)


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions with In) against a pod's labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for term in selector.get("matchExpressions", []):
        assert term["operator"] == "In", term
        if labels.get(term["key"]) not in term["values"]:
            return False
    return True


def test_pod_monitor_scrapes_the_workers_metrics_port(k8s_bin_dir: Path, tmp_path: Path):
    values = {"monitoring": {"serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}}}}
    docs = _documents(_helm_template(k8s_bin_dir, tmp_path, values, *MONITOR_APIS).stdout)
    monitor = next(d for d in docs if d["kind"] == "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == "splitserve" and monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert monitor["spec"]["podMetricsEndpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    # It selects the pods the operator builds, by their labels, and their port of that name.
    pod = _worker_pod()
    assert _selects(monitor["spec"]["selector"], pod["metadata"]["labels"])
    frontend = builders.build_frontend_deployment(builders.Owner("llm", "splitserve", "uid"),
                                                  ServingDeploymentSpec.from_dict({"model": {"source": "smollm2"}}))
    assert not _selects(monitor["spec"]["selector"], frontend["spec"]["template"]["metadata"]["labels"])
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert ports["metrics"] == names.WORKER_METRICS_PORT
    # The workers' NetworkPolicy lets Prometheus reach that port (and only that one, from anyone).
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-workers"))
    assert {"ports": [{"port": "metrics", "protocol": "TCP"}]} in policy["spec"]["ingress"]
    # Frontends (and the operator) reach the gRPC port and the session stream the operator configures.
    clients = next(rule for rule in policy["spec"]["ingress"]
                   if {"podSelector": {"matchLabels": {"splitserve.io/role": "operator"}}} in rule.get("from", []))
    assert {p["port"] for p in clients["ports"]} == {names.WORKER_PORT, names.WORKER_SESSION_PORT}
    assert ports["session"] == names.WORKER_SESSION_PORT
    scoped = {"networkPolicy": {"workerMetricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "mon"}}}]}}
    policy = next(d for d in _documents(_helm_template(k8s_bin_dir, tmp_path, scoped).stdout)
                  if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-workers"))
    assert {"from": scoped["networkPolicy"]["workerMetricsFrom"],
            "ports": [{"port": "metrics", "protocol": "TCP"}]} in policy["spec"]["ingress"]


def test_dashboard_queries_only_exported_worker_metrics(k8s_bin_dir: Path, tmp_path: Path):
    docs = _documents(_helm_template(k8s_bin_dir, tmp_path).stdout)
    dashboard = json.loads(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["splitserve.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exported = ({name for name, _, _ in (*GAUGES, *TIER_GAUGES)}
                | {f"{name}_total" for name, _, _ in (*COUNTERS, *TIER_COUNTERS)} | {f"{TIER_DROPPED}_total"})
    queried = {m for e in exprs for m in re.findall(r"splitserve_worker_[a-z_]+", e)}
    # The frontend's Stats-fed prefill counters are not the workers' (fault_metrics.py).
    queried -= {"splitserve_worker_prefill_retries_total", "splitserve_worker_prefill_fallbacks_total"}
    assert "splitserve_worker_kv_usage" in queried and queried <= exported, queried - exported
    assert any("by (worker)" in e and "splitserve_worker_kv_usage" in e for e in exprs)
    assert any("by (direction)" in e and "splitserve_kv_transfer_bytes_total" in e for e in exprs)


@pytest.mark.parametrize("flag, message", [
    ("operator.replicas=-1", "at '/operator/replicas': minimum: got -1, want 0"),
    ("image.pullPolicy=Sometimes", "at '/image/pullPolicy'"),
    ("etcd.external.endpoints={etcd:2379}", "at '/etcd/external/endpoints/0'"),
    ("networkPolicy.workerGrpcPort=70000", "at '/networkPolicy/workerGrpcPort': maximum"),
    ("operatr.replicas=1", "additional properties 'operatr' not allowed"),
    ("tls.enabled=true", "at '/tls/secretName': minLength"),
    ("sample.name=Not_A_Name", "at '/sample/name'"),
    ("gateway.enabled=true", "at '/gateway/deployment': minLength: got 0, want 1"),
    ("gateway.failureMode=Sometimes", "at '/gateway/failureMode'"),
    ("gateway.targetPort=0", "at '/gateway/targetPort': minimum"),
    ("gateway.httpRoute.enabled=true", "at '/gateway/httpRoute/parentRefs': minItems: got 0, want 1"),
])
def test_schema_rejects_bad_values(k8s_bin_dir: Path, tmp_path: Path, flag: str, message: str):
    proc = _helm_template(k8s_bin_dir, tmp_path, None, "--set", flag, check=False)
    assert proc.returncode != 0, proc.stdout[:500]
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert message in proc.stderr, proc.stderr


def _exists(cluster: KubeCluster, doc: dict) -> bool:
    kind, meta = doc["kind"], doc["metadata"]
    args = ["get", kind, meta["name"], "--ignore-not-found", "-o", "name"]
    if meta.get("namespace"):
        args += ["-n", meta["namespace"]]
    return bool(cluster.kubectl(*args).stdout.strip())


# (verb, resource, subresource or "", expected) as `kubectl auth can-i` sees the operator's ServiceAccount.
RBAC_EXPECTATIONS = [
    ("create", "pods", "binding", True), ("patch", "pods", "status", True), ("update", "pods", "status", False),
    ("delete", "pods", "", True), ("update", "pods", "", False), ("watch", "nodes", "", True),
    ("patch", "nodes", "", False), ("delete", "nodes", "", False),
    ("create", "deployments.apps", "", True), ("create", "statefulsets.apps", "", False),
    ("patch", "servingdeployments.splitserve.io", "status", True),
    ("update", "servingdeployments.splitserve.io", "scale", True),
    ("create", "servingdeployments.splitserve.io", "", False),
    ("create", "servingpools.splitserve.io", "", True), ("delete", "servingpools.splitserve.io", "", False),
    ("patch", "servingpools.splitserve.io", "status", True),
    ("delete", "servingdeployments.splitserve.io", "", False),
    ("list", "customresourcedefinitions.apiextensions.k8s.io", "", True),
    ("create", "customresourcedefinitions.apiextensions.k8s.io", "", False),
    ("get", "secrets", "", False), ("create", "events", "", True), ("create", "events.events.k8s.io", "", True),
    ("delete", "events", "", False), ("update", "leases.coordination.k8s.io", "", True),
    ("delete", "leases.coordination.k8s.io", "", False),
]


def test_install_creates_objects_and_uninstall_removes_them(kube_cluster: KubeCluster, k8s_namespace: str,
                                                            tmp_path: Path):
    ns, release = k8s_namespace, "ss"
    values = {"sample": {"enabled": True, "name": "sample"}}
    (tmp_path / "v.yaml").write_text(yaml.safe_dump(values))
    kube_cluster.helm("install", release, str(CHART), "-n", ns, "-f", str(tmp_path / "v.yaml"), timeout=180)
    manifest = _documents(kube_cluster.helm("get", "manifest", release, "-n", ns).stdout)
    print("\n".join(_summary(manifest)))
    assert len(manifest) >= 15
    for doc in manifest:
        assert _exists(kube_cluster, doc), f"{doc['kind']}/{doc['metadata']['name']} not created"
    assert _exists(kube_cluster, {"kind": "crd", "metadata": {"name": "servingdeployments.splitserve.io"}})

    sa = f"system:serviceaccount:{ns}:{release}-splitserve-operator"
    for verb, resource, sub, expected in RBAC_EXPECTATIONS:
        args = ["auth", "can-i", verb, resource, f"--as={sa}", "-n", ns]
        if sub:
            args.append(f"--subresource={sub}")
        answer = kube_cluster.kubectl(*args, check=False).stdout.strip()
        assert answer == ("yes" if expected else "no"), (verb, resource, sub, answer)

    kube_cluster.helm("uninstall", release, "-n", ns, "--wait", "--timeout", "60s", timeout=120)
    for doc in manifest:
        wait_until(lambda: not _exists(kube_cluster, doc), timeout=30,
                   what=f"{doc['kind']}/{doc['metadata']['name']} to be deleted")


# ---- the gateway switch (issue 40) -------------------------------------------------------------

GATEWAY = {"gateway": {"enabled": True, "deployment": "llm", "installCRDs": True,
                       "objectives": [{"name": "critical", "priority": 10}, {"name": "batch", "priority": -1}],
                       "httpRoute": {"enabled": True, "parentRefs": [{"name": "inference-gateway"}]}}}
GATEWAY_KINDS = {"InferencePool", "HTTPRoute", "InferenceObjective"}


def _by_kind_name(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_vendored_inference_pool_crd_is_gie_v1_6_0_unchanged():
    data = GIE_CRD_FILE.read_bytes()
    assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == GIE_CRD_BLOB
    crd = yaml.safe_load(data)
    assert crd["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == GIE_VERSION
    subchart = yaml.safe_load((GIE_CRD_FILE.parents[1] / "Chart.yaml").read_text())
    [dependency] = yaml.safe_load((CHART / "Chart.yaml").read_text())["dependencies"]
    assert subchart["appVersion"] == GIE_VERSION and dependency["version"] == subchart["version"] == "1.6.0"
    assert dependency["condition"] == "gateway.installCRDs"
    assert GIE_VERSION in (CHART / "values.yaml").read_text()
    data = OBJECTIVE_CRD_FILE.read_bytes()
    assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == OBJECTIVE_CRD_BLOB
    crd = yaml.safe_load(data)
    assert crd["metadata"]["name"] == OBJECTIVE_CRD_NAME
    assert crd["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == "v1.5.0"
    assert [v["name"] for v in crd["spec"]["versions"]] == ["v1alpha2"]


def test_gateway_off_renders_none_of_it(k8s_bin_dir: Path, tmp_path: Path):
    for values in (None, {"gateway": {**GATEWAY["gateway"], "enabled": False, "installCRDs": False}}):
        docs = _documents(_helm_template(k8s_bin_dir, tmp_path, values).stdout)
        assert not GATEWAY_KINDS & {d["kind"] for d in docs}
        rendered = {d["metadata"]["name"] for d in docs}
        assert GIE_CRD_NAME not in rendered and not [n for n in rendered if n.endswith("-epp")]
    # The CRD has its own switch: the pool without it (the gateway's install brought the CRD).
    docs = _documents(_helm_template(k8s_bin_dir, tmp_path, {"gateway": {**GATEWAY["gateway"],
                                                                          "installCRDs": False}}).stdout)
    assert "InferencePool" in {d["kind"] for d in docs} and GIE_CRD_NAME not in {d["metadata"]["name"] for d in docs}


def test_gateway_renders_the_pool_its_endpoint_picker_and_route(k8s_bin_dir: Path, tmp_path: Path):
    docs = _documents(_helm_template(k8s_bin_dir, tmp_path, GATEWAY).stdout)
    routed = _validate_all(docs)          # the EPP's Deployment, Service, RBAC and the GIE CRD: strict
    print("\n".join(_summary(docs)))
    objects = _by_kind_name(docs)
    assert yaml.safe_load(GIE_CRD_FILE.read_text()) == objects["CustomResourceDefinition", GIE_CRD_NAME]
    assert yaml.safe_load(OBJECTIVE_CRD_FILE.read_text()) == objects["CustomResourceDefinition", OBJECTIVE_CRD_NAME]
    objectives = [d for d in routed if d["kind"] == "InferenceObjective"]
    assert [(o["apiVersion"], o["metadata"]["name"], o["metadata"]["namespace"], o["spec"]) for o in objectives] == [
        ("inference.networking.x-k8s.io/v1alpha2", name, "splitserve",
         {"priority": priority, "poolRef": {"group": "inference.networking.k8s.io", "name": "llm"}})
        for name, priority in (("critical", 10), ("batch", -1))]
    pool = next(d for d in routed if d["kind"] == "InferencePool")
    service = objects["Service", "rel-splitserve-epp"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["metadata"]["name"] == "llm"
    assert pool["spec"] == {"selector": {"matchLabels": {"splitserve.io/deployment": "llm", "splitserve.io/rank": "0"}},
                            "targetPorts": [{"number": 8000}],
                            "endpointPickerRef": {"kind": "Service", "name": service["metadata"]["name"],
                                                  "port": {"number": 9002}, "failureMode": "FailClose"}}
    # The pool takes the pods the operator builds for that ServingDeployment in gateway mode, not
    # another's; its workers (with the llm-d.ai/role label the EPP keeps) serve on the target port.
    owner = builders.Owner("llm", "splitserve", "uid")
    spec = ServingDeploymentSpec.from_dict({"model": {"source": "smollm2"}, "gateway": {"enabled": True}})
    worker = builders.build_worker_pod(owner, spec, "decode", "llm-decode-1", 0)
    assert _selects(pool["spec"]["selector"], worker["metadata"]["labels"])
    assert names.LABEL_LLMD_ROLE in worker["metadata"]["labels"]
    ports = {p["containerPort"] for c in worker["spec"]["containers"] for p in c.get("ports", [])}
    assert pool["spec"]["targetPorts"][0]["number"] in ports
    frontend = builders.build_frontend_deployment(owner, spec)["spec"]["template"]["metadata"]["labels"]
    assert not _selects(pool["spec"]["selector"], frontend)     # a stock EPP would take it as a decode pod
    assert not _selects(pool["spec"]["selector"], builders.build_worker_pod(owner, spec, "decode", "llm-decode-1",
                                                                            1)["metadata"]["labels"])
    other = builders.build_worker_pod(builders.Owner("other", "splitserve", "uid"), spec, "decode", "o-1", 0)
    assert not _selects(pool["spec"]["selector"], other["metadata"]["labels"])
    # endpointPickerRef -> the Service's h2c port 9002 -> the EPP pods' container port `grpc`.
    epp = objects["Deployment", "rel-splitserve-epp"]
    template = epp["spec"]["template"]
    assert _selects({"matchLabels": service["spec"]["selector"]}, template["metadata"]["labels"])
    assert service["spec"]["ports"] == [
        {"name": "grpc", "protocol": "TCP", "port": 9002, "targetPort": "grpc", "appProtocol": "kubernetes.io/h2c"},
        {"name": "metrics", "protocol": "TCP", "port": 9090, "targetPort": "metrics"}]
    [container] = template["spec"]["containers"]
    assert container["command"] == ["splitserve", "--log-level", "INFO", "epp"]    # gateway.epp.logLevel
    parsed = build_parser().parse_args(container["command"][1:] + container["args"])
    assert (parsed.command, parsed.log_level, parsed.pool_name) == ("epp", "INFO", "llm")
    assert container["args"] == ["--pool-name", "llm", "--pool-namespace", "splitserve", "--model", "smollm2",
                                 "--host", "0.0.0.0", "--port", "9002", "--health-port", "9003",
                                 "--metrics-port", "9090"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"grpc": 9002, "grpc-health": 9003,
                                                                           "metrics": 9090}
    assert container["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert epp["spec"]["replicas"] == 1 and template["metadata"]["annotations"]["prometheus.io/port"] == "9090"
    # Its identity and what it may read, in the release namespace only.
    assert template["spec"]["serviceAccountName"] == "rel-splitserve-epp"
    assert ("ServiceAccount", "rel-splitserve-epp") in objects
    role, binding = objects["Role", "rel-splitserve-epp"], objects["RoleBinding", "rel-splitserve-epp"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "splitserve"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                             {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
                              "verbs": ["get", "list", "watch"]},
                             {"apiGroups": ["inference.networking.x-k8s.io"], "resources": ["inferenceobjectives"],
                              "verbs": ["get", "list", "watch"]}]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-splitserve-epp",
                                    "namespace": "splitserve"}]
    assert not [d for d in docs if d["kind"].startswith("Cluster") and "epp" in d["metadata"]["name"]]
    route = next(d for d in routed if d["kind"] == "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"] == {"parentRefs": [{"name": "inference-gateway"}], "rules": [{
        "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
        "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llm"}],
        "timeouts": {"request": "300s"}}]}
    # The workers admit the gateway on the pool's target port and the EPP; the EPP admits the gateway.
    workers_policy = objects["NetworkPolicy", "rel-splitserve-workers"]["spec"]
    assert _selects(workers_policy["podSelector"], worker["metadata"]["labels"])
    workers = workers_policy["ingress"]
    assert {"ports": [{"port": 8000, "protocol": "TCP"}]} in workers
    assert {"from": [{"podSelector": {"matchLabels": {"splitserve.io/role": "epp"}}}],
            "ports": [{"protocol": "TCP", "port": 50051}, {"protocol": "TCP", "port": "metrics"}]} in workers
    assert _selects({"matchLabels": {"splitserve.io/role": "epp"}}, template["metadata"]["labels"])
    epp_policy = objects["NetworkPolicy", "rel-splitserve-epp"]["spec"]
    assert _selects(epp_policy["podSelector"], template["metadata"]["labels"])
    assert epp_policy["ingress"][0] == {"ports": [{"port": 9002, "protocol": "TCP"}]}


def test_gateway_values_reach_the_objects(k8s_bin_dir: Path, tmp_path: Path):
    docs = _documents(_helm_template(k8s_bin_dir, tmp_path, ALL_OPTIONS, *MONITOR_APIS).stdout)
    objects = _by_kind_name(docs)
    pool = objects["InferencePool", "demo-pool"]["spec"]
    assert pool["selector"]["matchLabels"] == {"splitserve.io/deployment": "demo", "splitserve.io/rank": "0"}
    assert pool["targetPorts"] == [{"number": 8080}] and pool["endpointPickerRef"]["failureMode"] == "FailOpen"
    epp = objects["Deployment", "rel-splitserve-epp"]
    pod = epp["spec"]["template"]["spec"]
    assert epp["spec"]["replicas"] == 2 and pod["nodeSelector"] == {"node-role": "system"}
    assert pod["tolerations"] == ALL_OPTIONS["gateway"]["epp"]["tolerations"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["containers"][0]["image"] == "registry.example/splitserve:0.1.0-test"
    assert pod["containers"][0]["args"][1] == "demo-pool" and pod["containers"][0]["args"][-2:] == ["--log-level",
                                                                                                    "debug"]
    route = objects["HTTPRoute", "demo-pool"]["spec"]
    assert route["parentRefs"] == ALL_OPTIONS["gateway"]["httpRoute"]["parentRefs"]
    assert route["hostnames"] == ["llm.example.com"]
    assert route["rules"][0]["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    assert route["rules"][0]["timeouts"] == {"request": "10m"}
    gateway_from = ALL_OPTIONS["networkPolicy"]["gatewayFrom"]
    workers = objects["NetworkPolicy", "rel-splitserve-workers"]["spec"]["ingress"]
    assert {"from": gateway_from, "ports": [{"port": 8080, "protocol": "TCP"}]} in workers
    epp_policy = objects["NetworkPolicy", "rel-splitserve-epp"]["spec"]
    assert epp_policy["ingress"][0] == {"from": gateway_from, "ports": [{"port": 9002, "protocol": "TCP"}]}


@pytest.mark.parametrize("values, message", [
    ({"enabled": True}, "gateway.deployment must be set when gateway.enabled is true"),
    ({"enabled": True, "deployment": "llm", "httpRoute": {"enabled": True}},
     "gateway.httpRoute.parentRefs must be set when gateway.httpRoute.enabled is true"),
])
def test_gateway_templates_fail_fast_without_the_schema(k8s_bin_dir: Path, tmp_path: Path, values: dict,
                                                        message: str):
    """The schema refuses these first (test_schema_rejects_bad_values); the templates too."""
    proc = _helm_template(k8s_bin_dir, tmp_path, {"gateway": values}, "--skip-schema-validation", check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


# (verb, resource, namespace or None for the release's, expected) as the EPP's ServiceAccount.
EPP_RBAC_EXPECTATIONS = [
    ("get", "pods", None, True), ("list", "pods", None, True), ("watch", "pods", None, True),
    ("get", "inferencepools.inference.networking.k8s.io", None, True),
    ("list", "inferencepools.inference.networking.k8s.io", None, True),
    ("watch", "inferencepools.inference.networking.k8s.io", None, True),
    ("list", "inferenceobjectives.inference.networking.x-k8s.io", None, True),
    ("watch", "inferenceobjectives.inference.networking.x-k8s.io", None, True),
    ("create", "inferenceobjectives.inference.networking.x-k8s.io", None, False),
    ("create", "pods", None, False), ("delete", "pods", None, False), ("patch", "pods", None, False),
    ("update", "inferencepools.inference.networking.k8s.io", None, False),
    ("get", "secrets", None, False), ("list", "services", None, False),
    ("list", "pods", "default", False), ("watch", "inferencepools.inference.networking.k8s.io", "default", False),
]


def test_gateway_install_creates_the_crd_a_valid_pool_and_the_epp(kube_cluster: KubeCluster, k8s_namespace: str,
                                                                   tmp_path: Path):
    ns, release = k8s_namespace, "gw"
    # Helm must create the CRD itself here: none left over from another test of this session.
    for crd_name in (GIE_CRD_NAME, OBJECTIVE_CRD_NAME):
        kube_cluster.kubectl("delete", "crd", crd_name, "--ignore-not-found", "--wait", "--timeout=60s")
    values = {"gateway": {"enabled": True, "deployment": "llm", "failureMode": "FailOpen", "installCRDs": True,
                          "objectives": [{"name": "critical", "priority": 10}]}}
    (tmp_path / "v.yaml").write_text(yaml.safe_dump(values))
    try:
        kube_cluster.helm("install", release, str(CHART), "-n", ns, "-f", str(tmp_path / "v.yaml"), timeout=180)
        crd = json.loads(kube_cluster.kubectl("get", "crd", GIE_CRD_NAME, "-o", "json").stdout)
        assert crd["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == GIE_VERSION
        assert {"type": "Established", "status": "True"}.items() <= next(
            c for c in crd["status"]["conditions"] if c["type"] == "Established").items()
        manifest = _documents(kube_cluster.helm("get", "manifest", release, "-n", ns).stdout)
        print("\n".join(_summary(manifest)))
        assert {"InferencePool", "InferenceObjective", "Deployment", "Service", "ServiceAccount", "Role",
                "RoleBinding"} <= {d["kind"] for d in manifest}
        for doc in manifest:
            assert _exists(kube_cluster, doc), f"{doc['kind']}/{doc['metadata']['name']} not created"

        # Read back: what the chart set, and what the CRD's schema defaulted.
        pool = json.loads(kube_cluster.kubectl("get", "inferencepool", "llm", "-n", ns, "-o", "json").stdout)
        assert pool["spec"]["selector"] == {"matchLabels": {"splitserve.io/deployment": "llm",
                                                            "splitserve.io/rank": "0"}}
        assert pool["spec"]["targetPorts"] == [{"number": 8000}]
        assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service",
                                                     "name": f"{release}-splitserve-epp",
                                                     "port": {"number": 9002}, "failureMode": "FailOpen"}
        assert pool["spec"]["appProtocol"] == "http"
        objective = json.loads(kube_cluster.kubectl("get", "inferenceobjective", "critical", "-n", ns, "-o",
                                                    "json").stdout)
        assert objective["spec"] == {"priority": 10, "poolRef": {"group": "inference.networking.k8s.io",
                                                                 "kind": "InferencePool", "name": "llm"}}
        _the_picker_follows_the_pools_objectives(kube_cluster, ns)
        # The apiserver refuses what GIE's CRD does not allow: an unknown failureMode (enum), a Service
        # reference without a port (its CEL rule).
        rendered = next(d for d in manifest if d["kind"] == "InferencePool")
        bad_mode = json.loads(json.dumps(rendered))
        bad_mode["spec"]["endpointPickerRef"]["failureMode"] = "Sometimes"
        no_port = json.loads(json.dumps(rendered))
        del no_port["spec"]["endpointPickerRef"]["port"]
        for bad, error in ((bad_mode, 'Unsupported value: "Sometimes"'),
                           (no_port, "port is required when kind is 'Service'")):
            bad["metadata"]["name"] = "bad"
            refused = kube_cluster.kubectl("create", "--dry-run=server", "-n", ns, "-o", "name", "-f", "-",
                                           input=yaml.safe_dump(bad), check=False)
            assert refused.returncode != 0 and error in refused.stderr, refused.stderr

        sa = f"system:serviceaccount:{ns}:{release}-splitserve-epp"
        for verb, resource, where, expected in EPP_RBAC_EXPECTATIONS:
            answer = kube_cluster.kubectl("auth", "can-i", verb, resource, f"--as={sa}", "-n", where or ns,
                                          check=False).stdout.strip()
            assert answer == ("yes" if expected else "no"), (verb, resource, where, answer)
        notes = kube_cluster.helm("get", "notes", release, "-n", ns).stdout
        assert "InferencePool llm" in notes and f"{release}-splitserve-epp.{ns}.svc:9002" in notes

        kube_cluster.helm("uninstall", release, "-n", ns, "--wait", "--timeout", "60s", timeout=120)
        for doc in manifest:
            wait_until(lambda: not _exists(kube_cluster, doc), timeout=30,
                       what=f"{doc['kind']}/{doc['metadata']['name']} to be deleted")
        # helm never deletes a CRD it installed from crds/.
        assert _exists(kube_cluster, {"kind": "crd", "metadata": {"name": GIE_CRD_NAME}})
    finally:
        for crd_name in (GIE_CRD_NAME, OBJECTIVE_CRD_NAME):
            kube_cluster.kubectl("delete", "crd", crd_name, "--ignore-not-found", "--wait", "--timeout=60s")


def _the_picker_follows_the_pools_objectives(kube_cluster: KubeCluster, ns: str) -> None:
    """The EPP's watch (services/epp/objectives.py) against the real apiserver: the chart's
    objective, a changed priority, another pool's objective left out, a deleted one gone."""
    book = ObjectiveBook()

    async def follow() -> None:
        watch = ObjectiveWatch(book, ns, "llm", window_s=5, api_client=kube_cluster.api_client())
        await watch.start()
        try:
            await async_wait_until(lambda: book.priority_of("critical") == -10, timeout=30,
                                   what="the chart's objective (priority 10) to be known")
            kube_cluster.kubectl("patch", "inferenceobjective", "critical", "-n", ns, "--type=merge",
                                 "-p", '{"spec": {"priority": 3}}')
            for name, pool, priority in (("elsewhere", "another-pool", 7), ("later", "llm", -2)):
                kube_cluster.kubectl("create", "-f", "-", input=yaml.safe_dump({
                    "apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferenceObjective",
                    "metadata": {"name": name, "namespace": ns},
                    "spec": {"priority": priority, "poolRef": {"name": pool}}}))
            await async_wait_until(lambda: book.priority_of("critical") == -3 and book.priority_of("later") == 2,
                                   timeout=30, what="the changed and the new objective to be followed")
            assert book.priority_of("elsewhere") is None          # another pool's
            kube_cluster.kubectl("delete", "inferenceobjective", "later", "elsewhere", "-n", ns)
            await async_wait_until(lambda: book.priority_of("later") is None, timeout=30,
                                   what="the deleted objective to be forgotten")
        finally:
            await watch.close()

    asyncio.run(follow())


def test_gateway_mode_pods_are_valid_and_the_crd_refuses_a_worker_port(kube_cluster: KubeCluster,
                                                                       k8s_namespace: str):
    """spec.gateway through the real CRD: the apiserver fills its defaults and takes gateway mode;
    the decode group the operator builds from it (rank 0: the worker and its `frontend`, with
    llm-d's role label; rank 1) passes the apiserver's own pod validation; a gateway port that the
    worker container already uses is refused by the CRD's rule."""
    from splitserve.services.spec.serving_deployment import GatewaySpec

    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    kube_cluster.kubectl("wait", "--for=condition=Established", "--timeout=30s",
                         "crd/servingdeployments.splitserve.io")

    def dry_run(doc: dict, check: bool = True) -> subprocess.CompletedProcess:
        return kube_cluster.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-",
                                    input=yaml.safe_dump(doc), check=check)

    def sd(spec: dict) -> dict:
        return {"apiVersion": "splitserve.io/v1alpha1", "kind": "ServingDeployment",
                "metadata": {"name": "gw", "namespace": k8s_namespace}, "spec": spec}

    plain = ServingDeploymentSpec.from_resource(json.loads(dry_run(sd({"model": {"source": "smollm2"}})).stdout))
    assert plain.gateway == GatewaySpec()
    created = dry_run(sd({"model": {"source": "smollm2"}, "decode": {"tensorParallel": 2},
                          "gateway": {"enabled": True, "port": 8080}}))
    spec = ServingDeploymentSpec.from_resource(json.loads(created.stdout))
    assert spec.gateway == GatewaySpec(enabled=True, port=8080)
    owner = builders.Owner("gw", k8s_namespace, "uid-1")
    rank0, rank1 = builders.build_group_pods(owner, spec, "decode", "gw-decode-abc12")
    for pod in (rank0, rank1):
        kubernetes_validate.validate(pod, K8S_SCHEMA_VERSION, strict=True)
        served = json.loads(dry_run({**pod, "metadata": {**pod["metadata"], "ownerReferences": []}}).stdout)
        assert served["metadata"]["labels"].get(names.LABEL_LLMD_ROLE) == ("decode" if pod is rank0 else None)
    assert [c["name"] for c in rank0["spec"]["containers"]] == ["worker", "frontend"]
    refused = dry_run(sd({"model": {"source": "smollm2"},
                          "gateway": {"enabled": True, "port": names.WORKER_METRICS_PORT}}), check=False)
    assert refused.returncode != 0
    assert "gateway.port must not be a port of the worker container" in " ".join(refused.stderr.split())
