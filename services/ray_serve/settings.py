"""What a Ray Serve deployment of splitserve is made of, as plain typed data.

`RayServeConfig` is the one description the application builder (app.py)
turns into Ray Serve deployments. It is built either from a ServingDeployment
spec (config.py: the same file the Kubernetes operator reads) or from the
`splitserve serve` flags. It is split so that what a replica is constructed
with (`WorkerSettings`, `IngressSettings`) never contains a replica count:
Ray Serve restarts replicas whose constructor arguments change, so scaling a
pool through the config must only touch `PoolPlan.replicas`.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.router.policies.kv import DEFAULT_PREFILL_WEIGHT


@dataclass(slots=True, frozen=True)
class EngineSettings:
    """The engine flags every worker of a deployment shares (`splitserve worker`'s).

    `engine` "vllm": each replica runs `<engine_python> -m splitserve worker --engine vllm ...
    -- <engine_args>` as its child process (worker_process.py); `block_size` None is vLLM's own.
    """

    model: str
    device: str = "cpu"
    dtype: str = "auto"
    block_size: int | None = 16
    kv_cache_gib: float = 1.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    threads: int | None = None
    engine: str = "builtin"                 # builtin | vllm
    engine_python: str | None = None        # vllm: the engine environment's python (None: the default one)
    engine_args: tuple[str, ...] = ()       # vllm: its own engine flags, after `--`
    weights_revision: str = ""              # spec.model.revision: names the weights in the fingerprint


@dataclass(slots=True, frozen=True)
class WorkerSettings:
    """What one worker replica is constructed with: its role, engine, TP degree and transfer."""

    role: str                          # prefill | decode | both
    engine: EngineSettings
    tensor_parallel: int = 1
    transfer: str = "auto"             # auto | nixl | tcp
    remote_prefill_threshold: int = 64
    prefill_timeout_s: float = 30.0
    drain_timeout_s: float = 30.0      # a stopping replica waits this long for its calls
    otlp_traces_endpoint: str | None = None   # export its spans there (splitserve/tracing.py); None: off


@dataclass(slots=True, frozen=True)
class RouterSettings:
    policy: str = "kv"
    prefill_policy: str | None = None
    prefill_weight: float = DEFAULT_PREFILL_WEIGHT
    temperature: float = 0.0
    remote_prefill_threshold: int = 64


@dataclass(slots=True, frozen=True)
class IngressSettings:
    """What one ingress (frontend) replica is constructed with."""

    model: str
    router: RouterSettings
    served_model_name: str | None = None
    migration_limit: int | None = None
    migration_wait_s: float | None = None   # None: the frontend's default
    tool_call_parser: str | None = None     # tool_choice="auto" (--enable-auto-tool-choice); None: refused
    otlp_traces_endpoint: str | None = None  # export its spans there (splitserve/tracing.py); None: off


@dataclass(slots=True, frozen=True)
class Autoscaling:
    """Ray Serve's autoscaling_config for one pool (ServingDeployment `autoscaling`)."""

    min_replicas: int
    max_replicas: int
    target_ongoing_requests: float = 2.0

    def to_ray(self) -> dict:
        from splitserve.services.ray_serve.autoscaling import POLICY_PATH

        return {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
                "policy": {"policy_function": POLICY_PATH}}


@dataclass(slots=True, frozen=True)
class PoolPlan:
    """One pool (prefill or decode): how many worker groups and what each group holds."""

    worker: WorkerSettings
    replicas: int
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    memory_bytes_per_rank: int | None = None
    autoscaling: Autoscaling | None = None
    placement_strategy: str = "STRICT_PACK"     # for a TP group's placement group

    @property
    def name(self) -> str:
        return {"prefill": "PrefillWorker", "decode": "DecodeWorker", "both": "Worker"}[self.worker.role]


@dataclass(slots=True, frozen=True)
class RayServeConfig:
    ingress: IngressSettings
    decode: PoolPlan                   # role decode, or both when there is no prefill pool
    prefill: PoolPlan | None = None
    ingress_replicas: int = 1
    http_port: int = 8000
    app_name: str = "splitserve"

    @property
    def pools(self) -> tuple[PoolPlan, ...]:
        return tuple(p for p in (self.prefill, self.decode) if p is not None)
