"""The `ServingDeployment` spec as typed dataclasses (the CRD's contract in Python).

The same document drives Kubernetes (the operator reads `.spec` of the custom
resource) and Ray (a Ray Serve application reads the same YAML file), so parsing
lives here, free of kopf and the kubernetes client. `from_dict` takes the
camelCase mapping exactly as it appears under `spec:`, fills defaults, and raises
`ValueError` naming the offending field (`spec.prefill.replicas: ...`) for
anything the CRD's openAPIV3Schema would also reject; `to_dict` writes it back
in the same shape, defaults included, so `from_dict(to_dict(s)) == s`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from splitserve.router.policies.kv import DEFAULT_PREFILL_WEIGHT

API_GROUP = "splitserve.io"
API_VERSION = "v1alpha1"
KIND = "ServingDeployment"
PLURAL = "servingdeployments"

DEFAULT_IMAGE = "ghcr.io/splitserve/splitserve:0.1.0"
# The image's vLLM flavour (deploy/image/Dockerfile, ENGINE=vllm): the workers of `engine: vllm` pools.
DEFAULT_VLLM_IMAGE = "ghcr.io/splitserve/splitserve:0.1.0-vllm"
ENGINES = ("builtin", "vllm")
# What moves a prompt's KV between vLLM prefill and decode workers (`splitserve worker --kv-connector`).
KV_CONNECTORS = ("splitserve", "nixl-vllm")
DTYPES = ("float32", "bfloat16", "float16")
ROUTER_POLICIES = ("kv", "round-robin", "random", "least-loaded", "power-of-two")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
TOPOLOGY_MODES = ("same-node", "same-label", "none")
POOL_NAMES = ("prefill", "decode")
# Flags of `splitserve worker` that the operator sets from the spec and the pod (builders.worker_args):
# an engineArgs entry may not set them again.
OPERATOR_WORKER_FLAGS = ("--role", "--model", "--dtype", "--device", "--tp", "--host", "--advertise-host",
                         "--port", "--worker-id", "--metrics-port", "--session-port",
                         "--remote-prefill-threshold", "--etcd", "--etcd-ca", "--etcd-cert", "--etcd-key")
# The worker container's ports (operator/controller/names.py: WORKER_PORT, WORKER_SESSION_PORT,
# DIST_PORT, WORKER_METRICS_PORT): a gateway-mode frontend in the same pod cannot listen on one.
WORKER_POD_PORTS = (50051, 50052, 29500, 8090)
# vLLM engine flags that the operator sets after `--` (tensor and pipeline parallel sizes from the
# pool) or that name what `splitserve worker` owns (the model, its own address): the engineArgs of
# an `engine: vllm` pool may not give them.
OPERATOR_VLLM_FLAGS = ("--model", "--host", "--port", "--tensor-parallel-size", "-tp",
                       "--pipeline-parallel-size", "-pp")


# --- field readers: each names the field path in its error ---------------------------------

def _mapping(d: Any, path: str) -> Mapping[str, Any]:
    if d is None:
        return {}
    if not isinstance(d, Mapping):
        raise ValueError(f"{path}: expected an object, got {type(d).__name__}")
    return d


def _reject_unknown(d: Mapping[str, Any], known: tuple[str, ...], path: str) -> None:
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {', '.join(unknown)}; known: {', '.join(known)}")


def _int(d: Mapping[str, Any], key: str, default: int, path: str, minimum: int | None = None) -> int:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{path}.{key}: expected an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{path}.{key}: must be >= {minimum}, got {value}")
    return value


def _float(d: Mapping[str, Any], key: str, default: float, path: str, minimum: float | None = None) -> float:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{path}.{key}: expected a number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{path}.{key}: must be >= {minimum}, got {value}")
    return float(value)


def _bool(d: Mapping[str, Any], key: str, default: bool, path: str) -> bool:
    value = d.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{path}.{key}: expected a boolean (true or false), got {value!r}")
    return value


def _positive(d: Mapping[str, Any], key: str, default: float | None, path: str, when: str = "") -> float:
    """A number > 0; `default` None: required (`when` says when, e.g. "when enabled")."""
    if d.get(key) is None and default is None:
        raise ValueError(f"{path}.{key}: required{f' {when}' if when else ''}")
    value = _float(d, key, default, path)
    if value <= 0:
        raise ValueError(f"{path}.{key}: must be > 0, got {value:g}")
    return value


def _str(d: Mapping[str, Any], key: str, default: str | None, path: str,
         choices: tuple[str, ...] | None = None) -> str:
    value = d.get(key, default)
    if value is None:
        raise ValueError(f"{path}.{key}: required")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and choices is None:
        value = str(value)  # cpu: 4 is as cpu: "4"
    if not isinstance(value, str) or not value:
        raise ValueError(f"{path}.{key}: expected a non-empty string, got {value!r}")
    if choices is not None and value not in choices:
        raise ValueError(f"{path}.{key}: {value!r} is not one of {', '.join(choices)}")
    return value


# --- the spec ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ModelSpec:
    source: str                      # `smollm2`, a Hugging Face folder, or a .gguf path
    dtype: str = "bfloat16"
    # Names the weights (a release tag) for revision-safe pairing instead of a digest of their
    # files that every new pod would compute (splitserve/checkpoints/fingerprint.py); "": digest.
    revision: str = ""

    @classmethod
    def from_dict(cls, d: Any, path: str = "spec.model") -> ModelSpec:
        if d is None:
            raise ValueError(f"{path}: required (at least model.source)")
        d = _mapping(d, path)
        _reject_unknown(d, ("source", "dtype", "revision"), path)
        return cls(source=_str(d, "source", None, path), dtype=_str(d, "dtype", "bfloat16", path, DTYPES),
                   revision=_str(d, "revision", None, path) if "revision" in d else "")

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "dtype": self.dtype, **({"revision": self.revision} if self.revision else {})}


@dataclass(frozen=True, slots=True)
class FrontendSpec:
    replicas: int = 1
    service_type: str = "ClusterIP"
    port: int = 8000

    @classmethod
    def from_dict(cls, d: Any, path: str = "spec.frontend") -> FrontendSpec:
        d = _mapping(d, path)
        _reject_unknown(d, ("replicas", "serviceType", "port"), path)
        port = _int(d, "port", 8000, path, minimum=1)
        if port > 65535:
            raise ValueError(f"{path}.port: must be <= 65535, got {port}")
        return cls(replicas=_int(d, "replicas", 1, path, minimum=0),
                   service_type=_str(d, "serviceType", "ClusterIP", path, SERVICE_TYPES), port=port)

    def to_dict(self) -> dict[str, Any]:
        return {"replicas": self.replicas, "serviceType": self.service_type, "port": self.port}


@dataclass(frozen=True, slots=True)
class GatewaySpec:
    """`spec.gateway`: a Gateway API Inference Extension gateway in front. Enabled, the rank-0 pod
    of every decode group also runs `splitserve frontend --gateway` on `port`, serving the OpenAI
    API for its own worker: the gateway's endpoint picker chose the pod, and names the prefill
    worker in a request header. The ordinary frontends stay."""

    enabled: bool = False
    port: int = 8000

    @classmethod
    def from_dict(cls, d: Any, path: str = "spec.gateway") -> GatewaySpec:
        d = _mapping(d, path)
        _reject_unknown(d, ("enabled", "port"), path)
        port = _int(d, "port", 8000, path, minimum=1)
        if port > 65535:
            raise ValueError(f"{path}.port: must be <= 65535, got {port}")
        if port in WORKER_POD_PORTS:
            raise ValueError(f"{path}.port: {port} is a port of the worker container in the same pod "
                             f"({', '.join(map(str, WORKER_POD_PORTS))}); choose another")
        return cls(enabled=_bool(d, "enabled", False, path), port=port)

    def to_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "port": self.port}


@dataclass(frozen=True, slots=True)
class RouterSpec:
    policy: str = "kv"
    prefill_weight: float = DEFAULT_PREFILL_WEIGHT
    temperature: float = 0.0

    @classmethod
    def from_dict(cls, d: Any, path: str = "spec.router") -> RouterSpec:
        d = _mapping(d, path)
        _reject_unknown(d, ("policy", "prefillWeight", "temperature"), path)
        return cls(policy=_str(d, "policy", "kv", path, ROUTER_POLICIES),
                   prefill_weight=_float(d, "prefillWeight", DEFAULT_PREFILL_WEIGHT, path, minimum=0.0),
                   temperature=_float(d, "temperature", 0.0, path, minimum=0.0))

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "prefillWeight": self.prefill_weight, "temperature": self.temperature}


@dataclass(frozen=True, slots=True)
class ResourcesSpec:
    cpu: str = "4"
    memory: str = "16Gi"

    @classmethod
    def from_dict(cls, d: Any, path: str) -> ResourcesSpec:
        d = _mapping(d, path)
        _reject_unknown(d, ("cpu", "memory"), path)
        return cls(cpu=_str(d, "cpu", "4", path), memory=_str(d, "memory", "16Gi", path))

    def to_dict(self) -> dict[str, Any]:
        return {"cpu": self.cpu, "memory": self.memory}


@dataclass(frozen=True, slots=True)
class TopologySpec:
    """Where a group's pods may go: all on one node, all on nodes sharing one value
    of `label_key`, or anywhere."""

    mode: str = "same-node"
    label_key: str | None = None

    @classmethod
    def from_dict(cls, d: Any, path: str) -> TopologySpec:
        d = _mapping(d, path)
        _reject_unknown(d, ("mode", "labelKey"), path)
        mode = _str(d, "mode", "same-node", path, TOPOLOGY_MODES)
        label_key = d.get("labelKey")
        if mode == "same-label":
            label_key = _str(d, "labelKey", None, path)
        elif label_key is not None:
            raise ValueError(f"{path}.labelKey: only allowed with mode same-label, not {mode}")
        return cls(mode=mode, label_key=label_key)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode}
        if self.label_key is not None:
            out["labelKey"] = self.label_key
        return out


@dataclass(frozen=True, slots=True)
class AutoscalingSpec:
    """Used by Ray Serve; the operator leaves replicas to `kubectl scale` / an HPA."""

    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 8.0

    @classmethod
    def from_dict(cls, d: Any, path: str) -> AutoscalingSpec:
        d = _mapping(d, path)
        _reject_unknown(d, ("minReplicas", "maxReplicas", "targetOngoingRequests"), path)
        low = _int(d, "minReplicas", 1, path, minimum=0)
        high = _int(d, "maxReplicas", max(low, 1), path, minimum=1)
        if high < low:
            raise ValueError(f"{path}: maxReplicas ({high}) must be >= minReplicas ({low})")
        target = _float(d, "targetOngoingRequests", 8.0, path)
        if target <= 0:
            raise ValueError(f"{path}.targetOngoingRequests: must be > 0, got {target}")
        return cls(min_replicas=low, max_replicas=high, target_ongoing_requests=target)

    def to_dict(self) -> dict[str, Any]:
        return {"minReplicas": self.min_replicas, "maxReplicas": self.max_replicas,
                "targetOngoingRequests": self.target_ongoing_requests}


@dataclass(frozen=True, slots=True)
class PoolBoundsSpec:
    """`spec.autoscaling.prefill` / `.decode`: the worker groups the SLO planner may give one pool."""

    min_replicas: int = 1
    max_replicas: int = 4

    @classmethod
    def from_dict(cls, d: Any, path: str) -> PoolBoundsSpec:
        d = _mapping(d, path)
        _reject_unknown(d, ("minReplicas", "maxReplicas"), path)
        low = _int(d, "minReplicas", 1, path, minimum=1)
        high = _int(d, "maxReplicas", max(low, 4), path, minimum=1)
        if high < low:
            raise ValueError(f"{path}: maxReplicas ({high}) must be >= minReplicas ({low})")
        return cls(min_replicas=low, max_replicas=high)

    def to_dict(self) -> dict[str, Any]:
        return {"minReplicas": self.min_replicas, "maxReplicas": self.max_replicas}


@dataclass(frozen=True, slots=True)
class CapacityProfileSpec:
    """`spec.autoscaling.profile`: one worker group's capacity, the SLO planner's starting point
    (services/planner/profile.py), refined online from the workers' Stats counters.

    prefill: prompt tokens/s of one group busy with prompts; decode: tokens/s one group
    generates at `decode_batch_size` running sequences (its inter-token latency is then
    decode_batch_size / decode_tokens_per_s); startup: seconds from creating a group to serving.
    """

    prefill_tokens_per_s: float = 8000.0
    decode_tokens_per_s: float = 800.0
    decode_batch_size: int = 32
    startup_s: float = 60.0
    kv_capacity_tokens: int | None = None

    _FIELDS = ("prefillTokensPerSecond", "decodeTokensPerSecond", "decodeBatchSize", "startupSeconds",
               "kvCapacityTokens")

    @classmethod
    def from_dict(cls, d: Any, path: str) -> CapacityProfileSpec:
        d = _mapping(d, path)
        _reject_unknown(d, cls._FIELDS, path)
        kv = d.get("kvCapacityTokens")
        return cls(prefill_tokens_per_s=_positive(d, "prefillTokensPerSecond", 8000.0, path),
                   decode_tokens_per_s=_positive(d, "decodeTokensPerSecond", 800.0, path),
                   decode_batch_size=_int(d, "decodeBatchSize", 32, path, minimum=1),
                   startup_s=_float(d, "startupSeconds", 60.0, path, minimum=0.0),
                   kv_capacity_tokens=None if kv is None else _int(d, "kvCapacityTokens", 0, path, minimum=1))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prefillTokensPerSecond": self.prefill_tokens_per_s,
                               "decodeTokensPerSecond": self.decode_tokens_per_s,
                               "decodeBatchSize": self.decode_batch_size, "startupSeconds": self.startup_s}
        if self.kv_capacity_tokens is not None:
            out["kvCapacityTokens"] = self.kv_capacity_tokens
        return out


@dataclass(frozen=True, slots=True)
class TracingSpec:
    """OpenTelemetry tracing of every frontend and worker pod (`--otlp-traces-endpoint`, vLLM's
    flag name): None leaves it off."""

    otlp_traces_endpoint: str | None = None

    @classmethod
    def from_dict(cls, d: Any, path: str = "spec.tracing") -> TracingSpec:
        d = _mapping(d, path)
        _reject_unknown(d, ("otlpTracesEndpoint",), path)
        if d.get("otlpTracesEndpoint") is None:
            return cls()
        endpoint = _str(d, "otlpTracesEndpoint", None, path)
        if not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"{path}.otlpTracesEndpoint: an OTLP/gRPC collector URL such as "
                             f"http://otel-collector.observability:4317, got {endpoint!r}")
        return cls(otlp_traces_endpoint=endpoint)

    def to_dict(self) -> dict[str, Any]:
        return {} if self.otlp_traces_endpoint is None else {"otlpTracesEndpoint": self.otlp_traces_endpoint}


@dataclass(frozen=True, slots=True)
class SloAutoscalingSpec:
    """`spec.autoscaling`: the operator sizes the prefill and decode pools with the SLO planner
    (services/planner; operator/controller/scaling_task.py), through their ServingPools' scale
    subresources. Not the per-pool `autoscaling` (Ray Serve's).

    Targets in milliseconds (p90 time to first token and inter-token latency), required when
    `enabled`; `max_workers` None: the sum of the pools' maxReplicas. `switch_modes`: the
    planner may also run the deployment aggregated, the prefill pool at 0 groups and the decode
    groups prefilling their own prompts (the router sends a request no prefill worker then).
    """

    enabled: bool = False
    ttft_p90_ms: float | None = None
    itl_p90_ms: float | None = None
    interval_s: int = 30
    cooldown_s: int = 300
    max_workers: int | None = None
    prefill: PoolBoundsSpec = field(default_factory=PoolBoundsSpec)
    decode: PoolBoundsSpec = field(default_factory=PoolBoundsSpec)
    profile: CapacityProfileSpec = field(default_factory=CapacityProfileSpec)
    switch_modes: bool = False

    _FIELDS = ("enabled", "switchModes", "ttftP90Ms", "itlP90Ms", "intervalSeconds", "cooldownSeconds", "maxWorkers",
               "prefill", "decode", "profile")

    @property
    def worker_limit(self) -> int:
        """The most worker groups of both pools together."""
        if self.max_workers is not None:
            return self.max_workers
        return self.prefill.max_replicas + self.decode.max_replicas

    def bounds(self, pool: str) -> PoolBoundsSpec:
        if pool == "prefill":
            return self.prefill
        if pool == "decode":
            return self.decode
        raise ValueError(f"unknown pool {pool!r}; pools: {', '.join(POOL_NAMES)}")

    @classmethod
    def from_dict(cls, d: Any, path: str = "spec.autoscaling") -> SloAutoscalingSpec:
        d = _mapping(d, path)
        _reject_unknown(d, cls._FIELDS, path)
        enabled = _bool(d, "enabled", False, path)
        targets = {}
        for key in ("ttftP90Ms", "itlP90Ms"):
            if enabled or d.get(key) is not None:
                targets[key] = _positive(d, key, None, path, "when autoscaling is enabled")
        prefill = PoolBoundsSpec.from_dict(d.get("prefill"), f"{path}.prefill")
        decode = PoolBoundsSpec.from_dict(d.get("decode"), f"{path}.decode")
        max_workers = None
        if d.get("maxWorkers") is not None:
            max_workers = _int(d, "maxWorkers", 0, path, minimum=2)
            floor = prefill.min_replicas + decode.min_replicas
            if max_workers < floor:
                raise ValueError(f"{path}.maxWorkers: must be >= prefill.minReplicas + decode.minReplicas "
                                 f"({floor}), got {max_workers}")
        return cls(enabled=enabled, ttft_p90_ms=targets.get("ttftP90Ms"), itl_p90_ms=targets.get("itlP90Ms"),
                   interval_s=_int(d, "intervalSeconds", 30, path, minimum=1),
                   cooldown_s=_int(d, "cooldownSeconds", 300, path, minimum=0),
                   max_workers=max_workers, prefill=prefill, decode=decode,
                   profile=CapacityProfileSpec.from_dict(d.get("profile"), f"{path}.profile"),
                   switch_modes=_bool(d, "switchModes", False, path))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"enabled": self.enabled, "switchModes": self.switch_modes}
        if self.ttft_p90_ms is not None:
            out["ttftP90Ms"] = self.ttft_p90_ms
        if self.itl_p90_ms is not None:
            out["itlP90Ms"] = self.itl_p90_ms
        out.update(intervalSeconds=self.interval_s, cooldownSeconds=self.cooldown_s)
        if self.max_workers is not None:
            out["maxWorkers"] = self.max_workers
        out.update(prefill=self.prefill.to_dict(), decode=self.decode.to_dict(), profile=self.profile.to_dict())
        return out


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One worker pool: `replicas` worker groups of `group_size` pods each.

    The built-in engine runs one pod per tensor/pipeline-parallel rank (a gang-scheduled group);
    vLLM spawns its own ranks, so an `engine: vllm` group is one pod holding every rank's GPUs.
    `engine_args` are the engine's own flags: the built-in engine's are `splitserve worker` flags
    (appended to it, as before `engine` existed), vLLM's go after `--` to its EngineArgs parser.
    `worker_args` are `splitserve worker` flags for either engine (--kv-cache-gib, --kv-store, ...).
    """

    replicas: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    gpus_per_rank: int = 1
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    topology: TopologySpec = field(default_factory=TopologySpec)
    autoscaling: AutoscalingSpec | None = None
    engine_args: tuple[str, ...] = ()
    engine: str = "builtin"             # resolved: the pool's own `engine`, else the deployment's
    worker_args: tuple[str, ...] = ()

    _FIELDS = ("replicas", "tensorParallel", "pipelineParallel", "gpusPerRank", "resources", "topology",
               "autoscaling", "engine", "workerArgs", "engineArgs")

    @property
    def num_ranks(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def group_size(self) -> int:
        """Pods per worker group."""
        return 1 if self.engine == "vllm" else self.num_ranks

    @property
    def gpus_per_pod(self) -> int:
        return self.gpus_per_rank * (self.num_ranks if self.engine == "vllm" else 1)

    @property
    def gpus_per_group(self) -> int:
        return self.group_size * self.gpus_per_pod

    @classmethod
    def from_dict(cls, d: Any, path: str, default_engine: str = "builtin") -> PoolSpec:
        d = _mapping(d, path)
        _reject_unknown(d, cls._FIELDS, path)
        auto = d.get("autoscaling")
        engine = _str(d, "engine", default_engine, path, ENGINES)
        worker_args = _worker_args(d.get("workerArgs"), f"{path}.workerArgs")
        if engine == "vllm":
            engine_args = _vllm_args(d.get("engineArgs"), f"{path}.engineArgs")
        else:
            engine_args = _worker_args(d.get("engineArgs"), f"{path}.engineArgs")
        return cls(replicas=_int(d, "replicas", 1, path, minimum=0),
                   tensor_parallel=_int(d, "tensorParallel", 1, path, minimum=1),
                   pipeline_parallel=_int(d, "pipelineParallel", 1, path, minimum=1),
                   gpus_per_rank=_int(d, "gpusPerRank", 1, path, minimum=0),
                   resources=ResourcesSpec.from_dict(d.get("resources"), f"{path}.resources"),
                   topology=TopologySpec.from_dict(d.get("topology"), f"{path}.topology"),
                   autoscaling=None if auto is None else AutoscalingSpec.from_dict(auto, f"{path}.autoscaling"),
                   engine_args=engine_args, engine=engine, worker_args=worker_args)

    def to_dict(self, default_engine: str = "builtin") -> dict[str, Any]:
        """`engine` is written only where it differs from `default_engine` (the deployment's),
        so a built-in pool's document, and so its spec hash, is what it was before engines."""
        out: dict[str, Any] = {"replicas": self.replicas, "tensorParallel": self.tensor_parallel,
                               "pipelineParallel": self.pipeline_parallel, "gpusPerRank": self.gpus_per_rank,
                               "resources": self.resources.to_dict(), "topology": self.topology.to_dict()}
        if self.autoscaling is not None:
            out["autoscaling"] = self.autoscaling.to_dict()
        if self.engine != default_engine:
            out["engine"] = self.engine
        if self.worker_args:
            out["workerArgs"] = list(self.worker_args)
        if self.engine_args:
            out["engineArgs"] = list(self.engine_args)
        return out


def _flag_list(value: Any, path: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(a, str) and a for a in value):
        raise ValueError(f"{path}: expected a list of non-empty strings, got {value!r}")
    if "--" in value:
        raise ValueError(f"{path}: a bare -- is not allowed: the operator puts it between splitserve's "
                         "flags (workerArgs) and an engine: vllm pool's vLLM flags (engineArgs)")
    return tuple(value)


def _worker_args(value: Any, path: str) -> tuple[str, ...]:
    """Flags of `splitserve worker`: any but those the operator sets."""
    args = _flag_list(value, path)
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in OPERATOR_WORKER_FLAGS:
            raise ValueError(f"{path}: {flag} is set by the operator from the spec and the pod "
                             f"(flags it owns: {', '.join(OPERATOR_WORKER_FLAGS)})")
        if flag == "--engine":
            raise ValueError(f"{path}: --engine is set by the operator from the engine field "
                             f"(spec.engine or the pool's engine: {', '.join(ENGINES)})")
    return args


def _vllm_args(value: Any, path: str) -> tuple[str, ...]:
    """vLLM engine flags (`vllm serve --help`'s engine group): any but those the operator sets.
    vLLM's parser reads `--max_model_len` as `--max-model-len`, so both spellings are checked."""
    args = _flag_list(value, path)
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--"):
            flag = "--" + flag[2:].replace("_", "-")
        if flag in OPERATOR_VLLM_FLAGS:
            where = {"--model": "spec.model.source", "--host": "the pod (splitserve worker serves the API)",
                     "--port": "the pod (splitserve worker serves the API)",
                     "--tensor-parallel-size": "the pool's tensorParallel", "-tp": "the pool's tensorParallel",
                     "--pipeline-parallel-size": "the pool's pipelineParallel",
                     "-pp": "the pool's pipelineParallel"}[flag]
            raise ValueError(f"{path}: {flag} is set by the operator from {where}; vLLM flags it owns: "
                             f"{', '.join(OPERATOR_VLLM_FLAGS)}")
    return args


@dataclass(frozen=True, slots=True)
class ServingDeploymentSpec:
    model: ModelSpec
    image: str = DEFAULT_IMAGE
    frontend: FrontendSpec = field(default_factory=FrontendSpec)
    router: RouterSpec = field(default_factory=RouterSpec)
    prefill: PoolSpec = field(default_factory=PoolSpec)
    decode: PoolSpec = field(default_factory=PoolSpec)
    disaggregation_threshold: int = 0
    migration_limit: int = 2
    drain_timeout_seconds: int = 300
    autoscaling: SloAutoscalingSpec = field(default_factory=SloAutoscalingSpec)
    engine: str = "builtin"              # the pools' engine unless a pool names its own
    vllm_image: str = DEFAULT_VLLM_IMAGE  # the workers of engine: vllm pools (the frontends run `image`)
    tracing: TracingSpec = field(default_factory=TracingSpec)
    kv_connector: str = "splitserve"    # engine: vllm pools: splitserve's connector or vLLM's NixlConnector
    gateway: GatewaySpec = field(default_factory=GatewaySpec)

    _FIELDS = ("image", "vllmImage", "model", "engine", "frontend", "router", "prefill", "decode",
               "disaggregationThreshold", "migrationLimit", "drainTimeoutSeconds", "autoscaling", "tracing",
               "kvConnector", "gateway")

    def worker_image(self, pool: str) -> str:
        return self.vllm_image if self.pool(pool).engine == "vllm" else self.image

    def pool(self, name: str) -> PoolSpec:
        if name == "prefill":
            return self.prefill
        if name == "decode":
            return self.decode
        raise ValueError(f"unknown pool {name!r}; pools: {', '.join(POOL_NAMES)}")

    @classmethod
    def from_dict(cls, d: Any, path: str = "spec") -> ServingDeploymentSpec:
        """Parse the mapping under `spec:`; raises ValueError naming the bad field."""
        d = _mapping(d, path)
        _reject_unknown(d, cls._FIELDS, path)
        engine = _str(d, "engine", "builtin", path, ENGINES)
        spec = cls(model=ModelSpec.from_dict(d.get("model"), f"{path}.model"),
                   image=_str(d, "image", DEFAULT_IMAGE, path),
                   frontend=FrontendSpec.from_dict(d.get("frontend"), f"{path}.frontend"),
                   router=RouterSpec.from_dict(d.get("router"), f"{path}.router"),
                   prefill=PoolSpec.from_dict(d.get("prefill"), f"{path}.prefill", engine),
                   decode=PoolSpec.from_dict(d.get("decode"), f"{path}.decode", engine),
                   disaggregation_threshold=_int(d, "disaggregationThreshold", 0, path, minimum=0),
                   migration_limit=_int(d, "migrationLimit", 2, path, minimum=0),
                   drain_timeout_seconds=_int(d, "drainTimeoutSeconds", 300, path, minimum=0),
                   autoscaling=SloAutoscalingSpec.from_dict(d.get("autoscaling"), f"{path}.autoscaling"),
                   engine=engine, vllm_image=_str(d, "vllmImage", DEFAULT_VLLM_IMAGE, path),
                   tracing=TracingSpec.from_dict(d.get("tracing"), f"{path}.tracing"),
                   kv_connector=_str(d, "kvConnector", "splitserve", path, KV_CONNECTORS),
                   gateway=GatewaySpec.from_dict(d.get("gateway"), f"{path}.gateway"))
        spec._check_engines_pair(path)
        return spec

    def has_prefill_pool(self) -> bool:
        """Prefill groups now, or possibly later (a planner may scale the prefill pool up from 0)."""
        return self.prefill.replicas > 0 or self.autoscaling.enabled or self.prefill.autoscaling is not None

    def _check_engines_pair(self, path: str) -> None:
        """A prefill pool's KV goes only to decode workers of the same engine and connector (the
        router pairs only equal transfer layouts): a mixed deployment would leave its prefill pool idle."""
        if self.has_prefill_pool() and self.prefill.engine != self.decode.engine:
            raise ValueError(f"{path}.prefill.engine: the prefill pool runs {self.prefill.engine} and the decode "
                             f"pool {self.decode.engine}; their KV layouts differ, so no prompt could be sent from "
                             f"one to the other: give both pools the same engine, or set prefill.replicas to 0")
        if self.kv_connector != "splitserve" and self.decode.engine != "vllm":
            raise ValueError(f"{path}.kvConnector: {self.kv_connector} is vLLM's own connector and needs "
                             f"engine vllm in both pools (the built-in engine moves KV with splitserve's)")

    @classmethod
    def from_resource(cls, body: Mapping[str, Any]) -> ServingDeploymentSpec:
        """Parse a whole ServingDeployment document (as `kubectl get -o yaml` prints it)."""
        kind = body.get("kind", KIND)
        if kind != KIND:
            raise ValueError(f"kind: expected {KIND}, got {kind!r}")
        return cls.from_dict(body.get("spec"))

    def to_dict(self) -> dict[str, Any]:
        return {"image": self.image, "vllmImage": self.vllm_image, "model": self.model.to_dict(),
                "engine": self.engine, "frontend": self.frontend.to_dict(), "router": self.router.to_dict(),
                "prefill": self.prefill.to_dict(self.engine), "decode": self.decode.to_dict(self.engine),
                "disaggregationThreshold": self.disaggregation_threshold,
                "migrationLimit": self.migration_limit, "drainTimeoutSeconds": self.drain_timeout_seconds,
                "autoscaling": self.autoscaling.to_dict(), "tracing": self.tracing.to_dict(),
                "kvConnector": self.kv_connector, "gateway": self.gateway.to_dict()}


# --- status --------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Condition:
    type: str                        # Ready | Progressing | Degraded
    status: str                      # "True" | "False" | "Unknown"
    reason: str
    message: str = ""
    last_transition_time: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "status": self.status, "reason": self.reason, "message": self.message,
                "lastTransitionTime": self.last_transition_time}


@dataclass(frozen=True, slots=True)
class GroupStatus:
    name: str
    phase: str                       # Pending | Bound | Ready | Draining | Drained | Failed
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "phase": self.phase, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class PoolStatus:
    ready: int = 0
    desired: int = 0
    groups: tuple[GroupStatus, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"ready": self.ready, "desired": self.desired, "groups": [g.to_dict() for g in self.groups]}
