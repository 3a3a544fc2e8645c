"""Build a `RayServeConfig` from a ServingDeployment file or from `splitserve serve` flags.

The file is the Kubernetes operator's: a whole `ServingDeployment` manifest
(`kind: ServingDeployment`, with `spec:`) or just the mapping under `spec:`,
parsed by `splitserve.services.spec.serving_deployment` so both targets read one schema. How it
maps onto Ray:

| spec | Ray Serve |
|---|---|
| model.source, model.dtype | every worker's engine; the ingress's tokenizer |
| frontend.replicas, frontend.port | ingress replicas; the HTTP proxy's port (`--on-ray`) |
| router.* | the ingress's router (the same policies) |
| prefill.replicas / decode.replicas | `num_replicas` (prefill 0: aggregated workers, role both) |
| *.autoscaling | `autoscaling_config` (min/max replicas, target ongoing requests) |
| *.tensorParallel, gpusPerRank, resources | engine TP degree; one placement-group bundle per rank |
| *.topology | same-node and same-label: STRICT_PACK (one node satisfies both); none: PACK |
| disaggregationThreshold | the decode workers' and router's remote-prefill threshold |
| migrationLimit | the frontend's migration limit |
| drainTimeoutSeconds | how long a stopping worker replica drains (Serve's graceful_shutdown_timeout_s follows) |
| image, vllmImage, frontend.serviceType | Kubernetes only (ignored) |
| model.revision | every worker's fingerprint names its weights by it (else a digest of the files) |
| engine, *.engine | builtin: the worker in the replica's process; vllm: the replica's child process (worker_process.py) |
| *.engineArgs (vllm) | vLLM's engine flags, after `--` of that child's `splitserve worker --engine vllm` |
| tracing.otlpTracesEndpoint | the ingress's and every worker replica's OTLP endpoint (else the flag's) |

What the spec does not say (KV pool size, batch limits, threads, transfer
backend) comes from `EngineSettings` defaults or the CLI flags. A GPU pool
(`gpusPerRank` > 0) runs its engine on `cuda`, a CPU pool on `cpu`.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from splitserve.errors import SplitserveError
from splitserve.services.launch.topology import default_served_name, plan_workers

from splitserve.services.ray_serve.settings import (Autoscaling, EngineSettings, IngressSettings, PoolPlan, RayServeConfig, RouterSettings,
                       WorkerSettings)

_MEMORY_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9,
                 "T": 10**12}


def parse_cpu(text: str) -> float:
    """A Kubernetes CPU quantity: "2", "0.5", "500m"."""
    try:
        return int(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        raise SplitserveError(f"bad CPU quantity {text!r}: expected e.g. 2, 0.5 or 500m") from None


def parse_memory(text: str) -> int:
    """A Kubernetes memory quantity: "512Mi", "16Gi", "1G", "1048576"."""
    for suffix in sorted(_MEMORY_UNITS, key=len, reverse=True):
        if text.endswith(suffix):
            number, scale = text[:-len(suffix)], _MEMORY_UNITS[suffix]
            break
    else:
        number, scale = text, 1
    try:
        return int(float(number) * scale)
    except ValueError:
        raise SplitserveError(f"bad memory quantity {text!r}: expected e.g. 512Mi or 16Gi") from None


def read_spec(path: str | Path):
    """The ServingDeploymentSpec in a YAML file (a whole manifest or just its spec)."""
    import yaml

    from splitserve.services.spec.serving_deployment import ServingDeploymentSpec

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SplitserveError(f"cannot read {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise SplitserveError(f"{path}: expected a ServingDeployment manifest or its spec, got {type(doc).__name__}")
    try:
        if "spec" in doc or "kind" in doc:
            return ServingDeploymentSpec.from_resource(doc)
        return ServingDeploymentSpec.from_dict(doc)
    except ValueError as exc:
        raise SplitserveError(f"{path}: {exc}") from None


def _pool(pool_spec, role: str, engine: EngineSettings, threshold: int, transfer: str,
          drain_timeout_s: float, otlp_traces_endpoint: str | None) -> PoolPlan:
    if pool_spec.pipeline_parallel != 1:
        raise SplitserveError(f"{role}.pipelineParallel: the engine has no pipeline parallelism yet; use 1")
    gpus = pool_spec.gpus_per_rank
    if pool_spec.engine == "vllm":        # the spec's engineArgs, else those after `--` on the command line
        engine = replace(engine, engine="vllm", engine_args=pool_spec.engine_args or engine.engine_args,
                         block_size=engine.block_size if engine.engine == "vllm" else None)
    else:
        engine = replace(engine, engine="builtin", engine_args=(), block_size=engine.block_size or 16)
    worker = WorkerSettings(role=role, engine=replace(engine, device="cuda" if gpus else "cpu"),
                            tensor_parallel=pool_spec.tensor_parallel, transfer=transfer,
                            remote_prefill_threshold=threshold, drain_timeout_s=drain_timeout_s,
                            otlp_traces_endpoint=otlp_traces_endpoint)
    auto = pool_spec.autoscaling
    return PoolPlan(worker=worker, replicas=pool_spec.replicas, cpus_per_rank=parse_cpu(pool_spec.resources.cpu),
                    gpus_per_rank=float(gpus), memory_bytes_per_rank=parse_memory(pool_spec.resources.memory),
                    autoscaling=None if auto is None else Autoscaling(auto.min_replicas, auto.max_replicas,
                                                                      auto.target_ongoing_requests),
                    placement_strategy="PACK" if pool_spec.topology.mode == "none" else "STRICT_PACK")


def config_from_spec(spec, engine: EngineSettings | None = None, transfer: str = "auto",
                     served_model_name: str | None = None, migration_wait_s: float | None = None,
                     otlp_traces_endpoint: str | None = None) -> RayServeConfig:
    """`engine` supplies what the spec does not say; its model and dtype come from the spec.
    Tracing: the spec's `tracing.otlpTracesEndpoint`, else `otlp_traces_endpoint` (the flag)."""
    engine = replace(engine or EngineSettings(model=spec.model.source), model=spec.model.source,
                     dtype=spec.model.dtype, weights_revision=spec.model.revision)
    threshold = spec.disaggregation_threshold
    router = RouterSettings(policy=spec.router.policy, prefill_weight=spec.router.prefill_weight,
                            temperature=spec.router.temperature, remote_prefill_threshold=threshold)
    aggregated = spec.prefill.replicas == 0 and spec.prefill.autoscaling is None
    drain = float(spec.drain_timeout_seconds)
    traces = spec.tracing.otlp_traces_endpoint or otlp_traces_endpoint
    decode = _pool(spec.decode, "both" if aggregated else "decode", engine, threshold, transfer, drain, traces)
    prefill = None if aggregated else _pool(spec.prefill, "prefill", engine, threshold, transfer, drain, traces)
    ingress = IngressSettings(model=spec.model.source, router=router,
                              served_model_name=served_model_name or default_served_name(spec.model.source),
                              migration_limit=spec.migration_limit, migration_wait_s=migration_wait_s,
                              otlp_traces_endpoint=traces)
    return RayServeConfig(ingress=ingress, decode=decode, prefill=prefill,
                          ingress_replicas=max(1, spec.frontend.replicas), http_port=spec.frontend.port)


# `serve` flags the Ray target does not apply yet: refused rather than silently ignored.
UNSUPPORTED_FLAGS = ("api_key", "api_keys_file", "tls_cert", "tls_key", "tls_ca", "transfer_token")


def config_from_args(args: argparse.Namespace) -> RayServeConfig:
    """`splitserve serve --on-ray`: the same flags `serve` takes, or --config FILE."""
    given = [f"--{name.replace('_', '-')}" for name in UNSUPPORTED_FLAGS if getattr(args, name, None)]
    if given:
        raise SplitserveError(f"{', '.join(given)}: not supported with --on-ray yet (API keys, TLS and "
                              "transfer tokens apply to `splitserve serve` and Kubernetes only)")
    if args.config:
        spec = read_spec(args.config)
        engine = _engine_from_args(args, spec.model.source)
        return config_from_spec(spec, engine, args.transfer, args.served_model_name,
                                getattr(args, "migration_wait", None), getattr(args, "otlp_traces_endpoint", None))
    roles = [w.role for w in plan_workers(args)]
    engine = _engine_from_args(args, args.model)
    threshold = args.remote_prefill_threshold
    traces = getattr(args, "otlp_traces_endpoint", None)

    def pool(role: str) -> PoolPlan:
        worker = WorkerSettings(role=role, engine=engine, tensor_parallel=args.tp, transfer=args.transfer,
                                remote_prefill_threshold=threshold, prefill_timeout_s=args.prefill_timeout,
                                otlp_traces_endpoint=traces)
        gpus = 1.0 if engine.device.startswith("cuda") else 0.0
        return PoolPlan(worker=worker, replicas=roles.count(role), cpus_per_rank=args.ray_cpus_per_worker,
                        gpus_per_rank=gpus)

    router = RouterSettings(policy=args.router, prefill_weight=args.prefill_weight,
                            temperature=args.router_temperature, remote_prefill_threshold=threshold)
    ingress = IngressSettings(model=args.model, router=router,
                              served_model_name=args.served_model_name or default_served_name(args.model),
                              migration_limit=getattr(args, "migration_limit", None),
                              migration_wait_s=getattr(args, "migration_wait", None),
                              tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                              otlp_traces_endpoint=traces)
    if args.aggregated:
        return RayServeConfig(ingress=ingress, decode=pool("both"), ingress_replicas=args.frontends,
                              http_port=args.port)
    return RayServeConfig(ingress=ingress, decode=pool("decode"), prefill=pool("prefill"),
                          ingress_replicas=args.frontends, http_port=args.port)


def _engine_from_args(args: argparse.Namespace, model: str) -> EngineSettings:
    """`--engine vllm` (the whole deployment) or a spec's `engine: vllm` pool (config_from_spec)
    runs vLLM workers; their block size is vLLM's own unless --block-size is given."""
    vllm = getattr(args, "engine", "builtin") == "vllm"
    return EngineSettings(model=model, device=args.device, dtype=args.dtype,
                          block_size=args.block_size if vllm else args.block_size or 16,
                          kv_cache_gib=args.kv_cache_gib, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_num_seqs=args.max_num_seqs, threads=args.threads,
                          engine="vllm" if vllm else "builtin", engine_python=getattr(args, "engine_python", None),
                          engine_args=tuple(args.engine_args) if vllm else ())
