"""Pure builders: a ServingDeployment in, the documents of the objects it owns out.

Nothing here talks to the apiserver, so unit tests cover every field. Each
builder returns a plain JSON document (as `kubectl get -o json` shows it), with
the owner reference that makes the garbage collector delete it with its
ServingDeployment, and the labels of `names.py`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import yaml

from splitserve.operator import names
from splitserve.services.spec.serving_deployment import API_GROUP, API_VERSION, KIND, PoolSpec, ServingDeploymentSpec

POOL_KIND = "ServingPool"
POOL_PLURAL = "servingpools"


@dataclass(frozen=True, slots=True)
class Owner:
    """The identity of the ServingDeployment that owns what is built."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Owner:
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])

    def reference(self) -> dict[str, Any]:
        return {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND, "name": self.name, "uid": self.uid,
                "controller": True, "blockOwnerDeletion": True}

    def metadata(self, name: str, labels: dict[str, str], annotations: dict[str, str] | None = None
                 ) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "namespace": self.namespace,
                                "labels": {**self.labels(), **labels}, "ownerReferences": [self.reference()]}
        if annotations:
            meta["annotations"] = annotations
        return meta

    def labels(self) -> dict[str, str]:
        return {names.LABEL_DEPLOYMENT: self.name, names.LABEL_MANAGED_BY: names.MANAGED_BY}


def content_hash(doc: Any) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def pool_spec_hash(spec: ServingDeploymentSpec, pool: str) -> str:
    """What a worker group's pods are built from, minus the group count: a change here
    means the group must be replaced (rolling update)."""
    p = spec.pool(pool)
    tracing = spec.tracing.to_dict()
    # Only when set, so that the pods of a deployment without tracing keep their hash (no roll).
    return content_hash({"image": spec.worker_image(pool), "model": spec.model.to_dict(),
                         "threshold": spec.disaggregation_threshold,
                         "pool": {**p.to_dict(), "replicas": None, "autoscaling": None},
                         **({"tracing": tracing} if tracing else {}),
                         # only when not the default: a deployment that never set it keeps its hash
                         **({"kvConnector": spec.kv_connector} if spec.kv_connector != "splitserve" else {}),
                         # the gateway frontend runs `image`, which a vLLM pool's hash does not hold
                         **({"gateway": {**spec.gateway.to_dict(), "image": spec.image}}
                            if has_gateway_frontend(spec, pool) else {})})[:10]


def has_gateway_frontend(spec: ServingDeploymentSpec, pool: str) -> bool:
    """spec.gateway: the pool's rank-0 pods also serve the OpenAI API (the decode pool's only:
    a prefill worker answers no client)."""
    return spec.gateway.enabled and pool == "decode"


# --- settings of the operator that every workload gets -------------------------------------

ETCD_TLS_MOUNT = "/etc/splitserve/etcd-tls"


@dataclass(slots=True, frozen=True)
class WorkloadOptions:
    """What the operator (from the chart) adds to every worker and frontend pod it creates."""

    # A Secret with ca.crt, tls.crt and tls.key: clients' TLS to an etcd that serves https and
    # requires client certificates. None: plaintext etcd.
    etcd_tls_secret: str | None = None


def _etcd_tls(workload: WorkloadOptions) -> tuple[list[str], list[dict], list[dict]]:
    """(flags, volumes, volume mounts) for the etcd client TLS of one pod."""
    if not workload.etcd_tls_secret:
        return [], [], []
    flags = ["--etcd-ca", f"{ETCD_TLS_MOUNT}/ca.crt", "--etcd-cert", f"{ETCD_TLS_MOUNT}/tls.crt",
             "--etcd-key", f"{ETCD_TLS_MOUNT}/tls.key"]
    volumes = [{"name": "etcd-tls", "secret": {"secretName": workload.etcd_tls_secret}}]
    return flags, volumes, [{"name": "etcd-tls", "mountPath": ETCD_TLS_MOUNT, "readOnly": True}]


POD_NAME_ENV = {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}


def _tracing_flags(spec: ServingDeploymentSpec) -> list[str]:
    endpoint = spec.tracing.otlp_traces_endpoint
    return [] if endpoint is None else ["--otlp-traces-endpoint", endpoint]


def _tracing_env(spec: ServingDeploymentSpec, pod_name: bool = False) -> list[dict]:
    """With tracing on, the pod's identity as OpenTelemetry resource attributes (Resource.create
    reads OTEL_RESOURCE_ATTRIBUTES); POD_NAME must come earlier in the pod's env (`pod_name`: add
    it here, for a pod that has no POD_NAME of its own)."""
    if spec.tracing.otlp_traces_endpoint is None:
        return []
    return [*([POD_NAME_ENV] if pod_name else []), {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "OTEL_RESOURCE_ATTRIBUTES",
             "value": "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)"}]


# --- worker groups -------------------------------------------------------------------------

def worker_args(spec: ServingDeploymentSpec, pool: str) -> list[str]:
    """The operator's own `splitserve worker` flags (builders' OPERATOR_WORKER_FLAGS)."""
    p = spec.pool(pool)
    # Decode workers take the pool's role whichever the engine, also while the prefill pool is at
    # 0 (they prefill their own prompts then): scaling the prefill pool never rolls them.
    args = ["worker", "--role", pool, "--model", spec.model.source, "--dtype", spec.model.dtype,
            "--device", "cuda" if p.gpus_per_rank > 0 else "cpu"]
    if p.engine == "vllm":
        # vLLM spawns its own ranks inside the pod: its parallel sizes go after `--` (vllm_args).
        args[1:1] = ["--engine", "vllm", "--kv-connector", spec.kv_connector]
    else:
        args += ["--tp", str(p.tensor_parallel)]
    return args + [
        "--host", "0.0.0.0", "--advertise-host", "$(POD_IP)", "--port", str(names.WORKER_PORT),
        "--worker-id", "$(POD_NAME)",
        "--metrics-port", str(names.WORKER_METRICS_PORT), "--session-port", str(names.WORKER_SESSION_PORT),
        "--remote-prefill-threshold", str(spec.disaggregation_threshold), "--etcd", "$(SPLITSERVE_ETCD)",
        *_tracing_flags(spec)]


def vllm_args(p: PoolSpec) -> list[str]:
    """What follows `--` for an engine: vllm pool: its engineArgs, then the parallel sizes."""
    args = [*p.engine_args, "--tensor-parallel-size", str(p.tensor_parallel)]
    if p.pipeline_parallel > 1:
        args += ["--pipeline-parallel-size", str(p.pipeline_parallel)]
    return args


def container_args(spec: ServingDeploymentSpec, pool: str, tls_flags: list[str]) -> list[str]:
    p = spec.pool(pool)
    args = worker_args(spec, pool) + tls_flags + list(p.worker_args)
    if p.engine == "vllm":
        return args + ["--", *vllm_args(p)]
    return args + list(p.engine_args)


def leader_address(owner: Owner, group: str) -> str:
    """The rank-0 pod's stable DNS name, through the deployment's headless Service."""
    return (f"{names.pod_name(group, 0)}.{names.workers_service_name(owner.name)}."
            f"{owner.namespace}.svc.cluster.local")


def probe_command() -> list[str]:
    """The active canary: gRPC health SERVING and a one-token Generate (operator/controller/probe.py)."""
    return ["python", "-m", "splitserve.operator.probe", "--address", f"127.0.0.1:{names.WORKER_PORT}"]


# How long a worker may take to load before it counts as failed: the built-in engine loads
# its weights; vLLM also profiles memory and (without --enforce-eager) compiles and captures CUDA
# graphs, which takes minutes on a first start.
STARTUP_SECONDS = {"builtin": 600, "vllm": 1800}


def startup_probe(p: PoolSpec) -> dict[str, Any]:
    """Plain gRPC health: SERVING once the engine is up (the readinessProbe's canary then runs)."""
    period = 5 if p.engine == "builtin" else 10
    return {"grpc": {"port": names.WORKER_PORT}, "periodSeconds": period,
            "failureThreshold": STARTUP_SECONDS[p.engine] // period}


def scrape_annotations(port: int) -> dict[str, str]:
    """For Prometheus setups that discover pods by annotation (the chart's PodMonitor and
    ServiceMonitor select by label and port name instead)."""
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def build_worker_pod(owner: Owner, spec: ServingDeploymentSpec, pool: str, group: str, rank: int,
                     workload: WorkloadOptions = WorkloadOptions()) -> dict[str, Any]:
    p: PoolSpec = spec.pool(pool)
    tls_flags, volumes, mounts = _etcd_tls(workload)
    name = names.pod_name(group, rank)
    labels = {names.LABEL_POOL: pool, names.LABEL_ROLE: pool, names.LABEL_GROUP: group,
              names.LABEL_RANK: str(rank), names.LABEL_SPEC_HASH: pool_spec_hash(spec, pool)}
    if rank == 0:
        # Endpoint pickers take every pod with it for an endpoint; ranks 1.. serve no API.
        labels[names.LABEL_LLMD_ROLE] = names.LLMD_ROLES[pool]
    topology = p.topology.mode + (f"={p.topology.label_key}" if p.topology.label_key else "")
    annotations = {names.ANN_GROUP_SIZE: str(p.group_size), names.ANN_TOPOLOGY: topology,
                   **scrape_annotations(names.WORKER_METRICS_PORT)}
    env = [
        POD_NAME_ENV,
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "SPLITSERVE_ETCD", "valueFrom": {"configMapKeyRef": {
            "name": names.config_map_name(owner.name), "key": "etcd"}}},
        {"name": "SPLITSERVE_GROUP", "value": group},
        {"name": "SPLITSERVE_POOL", "value": pool},
        *_tracing_env(spec),
        *([{"name": "SPLITSERVE_WEIGHTS_REVISION", "value": spec.model.revision}] if spec.model.revision else []),
    ]
    if p.group_size > 1:
        # `splitserve worker` joins its group through these (services/engine/parallel/rendezvous.py):
        # rank 0 hosts the rendezvous on the dist port, the others dial it by its stable DNS name.
        env += [{"name": "SPLITSERVE_TP_RANK", "value": str(rank)},
                {"name": "SPLITSERVE_TP_WORLD_SIZE", "value": str(p.group_size)},
                {"name": "SPLITSERVE_TP_LEADER", "value": f"{leader_address(owner, group)}:{names.DIST_PORT}"}]
    resources: dict[str, Any] = {"cpu": p.resources.cpu, "memory": p.resources.memory}
    limits = dict(resources)
    if p.gpus_per_pod > 0:
        resources[names.GPU_RESOURCE] = str(p.gpus_per_pod)
        limits[names.GPU_RESOURCE] = str(p.gpus_per_pod)
    container: dict[str, Any] = {
        "name": "worker", "image": spec.worker_image(pool), "command": ["splitserve"],
        "args": container_args(spec, pool, tls_flags), "env": env,
        "ports": [{"name": "grpc", "containerPort": names.WORKER_PORT},
                  {"name": "dist", "containerPort": names.DIST_PORT},
                  {"name": names.METRICS_PORT_NAME, "containerPort": names.WORKER_METRICS_PORT},
                  {"name": "session", "containerPort": names.WORKER_SESSION_PORT}],
        "resources": {"requests": resources, "limits": limits},
    }
    if mounts:
        container["volumeMounts"] = mounts
    if rank == 0:
        container["readinessProbe"] = {"exec": {"command": probe_command()}, "periodSeconds": 10,
                                       "timeoutSeconds": 8, "failureThreshold": 3}
        container["startupProbe"] = startup_probe(p)
    containers = [container]
    if rank == 0 and has_gateway_frontend(spec, pool):
        containers.append(build_gateway_frontend_container(spec))
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": owner.metadata(name, labels, annotations),
        "spec": {
            "schedulerName": names.SCHEDULER_NAME,
            # A rank that dies cannot rejoin its torch.distributed group: the operator
            # replaces the whole group instead of restarting one container.
            "restartPolicy": "Never",
            "hostname": name, "subdomain": names.workers_service_name(owner.name),
            "terminationGracePeriodSeconds": 30,
            "tolerations": [{"key": names.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
            "containers": containers,
            **({"volumes": volumes} if volumes else {}),
        },
    }


def build_group_pods(owner: Owner, spec: ServingDeploymentSpec, pool: str, group: str,
                     workload: WorkloadOptions = WorkloadOptions()) -> list[dict[str, Any]]:
    return [build_worker_pod(owner, spec, pool, group, rank, workload) for rank in range(spec.pool(pool).group_size)]


def build_workers_service(owner: Owner) -> dict[str, Any]:
    """Headless: gives every worker pod `<pod>.<service>` DNS (the leader address)."""
    name = names.workers_service_name(owner.name)
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": owner.metadata(name, {names.LABEL_ROLE: "workers"}),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {names.LABEL_DEPLOYMENT: owner.name, names.LABEL_RANK: "0"},
                     "ports": [{"name": "grpc", "port": names.WORKER_PORT},
                               {"name": "dist", "port": names.DIST_PORT}]}}


# --- frontend, config, pools ---------------------------------------------------------------

def frontend_args(spec: ServingDeploymentSpec) -> list[str]:
    return ["frontend", "--model", spec.model.source, "--router", spec.router.policy,
            "--prefill-weight", str(spec.router.prefill_weight),
            "--router-temperature", str(spec.router.temperature),
            "--remote-prefill-threshold", str(spec.disaggregation_threshold),
            "--etcd", "$(SPLITSERVE_ETCD)", "--host", "0.0.0.0", "--port", str(spec.frontend.port),
            "--grpc-port", str(spec.frontend.port + names.FRONTEND_GRPC_PORT_OFFSET), *_tracing_flags(spec)]


def frontend_resources() -> dict[str, Any]:
    return {"requests": {"cpu": "1", "memory": "2Gi"}}


def frontend_readiness(port: int) -> dict[str, Any]:
    """Ready once the frontend has a ready decode worker (its `/ready`)."""
    return {"httpGet": {"path": "/ready", "port": port}, "periodSeconds": 5}


def gateway_frontend_args(spec: ServingDeploymentSpec) -> list[str]:
    """spec.gateway's `splitserve frontend --gateway`: its one worker is the pod's own decode
    worker, on loopback (no etcd, no router: the gateway's endpoint picker chose the pod)."""
    return ["frontend", "--gateway", "--model", spec.model.source,
            "--worker", f"decode=127.0.0.1:{names.WORKER_PORT}",
            "--remote-prefill-threshold", str(spec.disaggregation_threshold),
            "--host", "0.0.0.0", "--port", str(spec.gateway.port), *_tracing_flags(spec)]


def build_gateway_frontend_container(spec: ServingDeploymentSpec) -> dict[str, Any]:
    """The second container of a decode group's rank-0 pod with spec.gateway: the pod serves
    the OpenAI API on the container port `http` (the InferencePool's target port)."""
    port = spec.gateway.port
    env = _tracing_env(spec, pod_name=True)
    return {"name": names.GATEWAY_CONTAINER, "image": spec.image, "command": ["splitserve"],
            "args": gateway_frontend_args(spec), **({"env": env} if env else {}),
            "ports": [{"name": "http", "containerPort": port}],
            "readinessProbe": frontend_readiness(port), "resources": frontend_resources()}


def build_frontend_deployment(owner: Owner, spec: ServingDeploymentSpec,
                              workload: WorkloadOptions = WorkloadOptions()) -> dict[str, Any]:
    name = names.frontend_name(owner.name)
    tls_flags, volumes, mounts = _etcd_tls(workload)
    select = {names.LABEL_DEPLOYMENT: owner.name, names.LABEL_ROLE: "frontend"}
    port = spec.frontend.port
    container = {
        "name": "frontend", "image": spec.image, "command": ["splitserve"], "args": frontend_args(spec) + tls_flags,
        "env": [{"name": "SPLITSERVE_ETCD", "valueFrom": {"configMapKeyRef": {
            "name": names.config_map_name(owner.name), "key": "etcd"}}},
                *_tracing_env(spec, pod_name=True)],
        "ports": [{"name": "http", "containerPort": port},
                  {"name": "grpc", "containerPort": port + names.FRONTEND_GRPC_PORT_OFFSET}],
        "readinessProbe": frontend_readiness(port),
        "resources": frontend_resources(),
        **({"volumeMounts": mounts} if mounts else {}),
    }
    pod_spec: dict[str, Any] = {"containers": [container], **({"volumes": volumes} if volumes else {})}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": owner.metadata(name, {names.LABEL_ROLE: "frontend"}),
            "spec": {"replicas": spec.frontend.replicas, "selector": {"matchLabels": select},
                     "template": {"metadata": {"labels": {**owner.labels(), **select},
                                               "annotations": scrape_annotations(port)},
                                  "spec": pod_spec}}}


def build_frontend_service(owner: Owner, spec: ServingDeploymentSpec) -> dict[str, Any]:
    port = spec.frontend.port
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": owner.metadata(names.frontend_name(owner.name), {names.LABEL_ROLE: "frontend"}),
            "spec": {"type": spec.frontend.service_type,
                     "selector": {names.LABEL_DEPLOYMENT: owner.name, names.LABEL_ROLE: "frontend"},
                     "ports": [{"name": "http", "port": port, "targetPort": "http"},
                               {"name": "grpc", "port": port + names.FRONTEND_GRPC_PORT_OFFSET,
                                "targetPort": "grpc"}]}}


def build_config_map(owner: Owner, spec: ServingDeploymentSpec, etcd_endpoints: list[str]) -> dict[str, Any]:
    """The spec as a file (`servingdeployment.yaml`, the document Ray reads too) and every etcd
    endpoint, comma-separated (the pods' `--etcd $(SPLITSERVE_ETCD)` takes such a list)."""
    document = {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND,
                "metadata": {"name": owner.name, "namespace": owner.namespace}, "spec": spec.to_dict()}
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": owner.metadata(names.config_map_name(owner.name), {}),
            "data": {"servingdeployment.yaml": yaml.safe_dump(document, sort_keys=False),
                     "etcd": ",".join(etcd_endpoints)}}


def build_serving_pool(owner: Owner, pool: str, replicas: int) -> dict[str, Any]:
    """The per-pool child whose `scale` subresource makes each pool `kubectl scale`-able."""
    return {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": POOL_KIND,
            "metadata": owner.metadata(names.pool_resource_name(owner.name, pool), {names.LABEL_POOL: pool},
                                       {names.ANN_SYNCED_REPLICAS: str(replicas)}),
            "spec": {"deployment": owner.name, "pool": pool, "replicas": replicas}}
