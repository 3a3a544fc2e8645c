"""The command lines and environment `splitserve serve` gives its children.

Each worker and frontend is started as `python -m splitserve worker|frontend ...`
with the flags that `serve` forwards to it; secrets (API keys, the KV transfer
token) go by environment, never on a command line that `ps` shows.
"""

from __future__ import annotations

import argparse
import os

from splitserve.services.launch.topology import PlannedWorker, default_served_name

GRACE_S = 10.0
DRAIN_S = GRACE_S - 3.0      # children drain (finish running requests) within the grace period


def engine_argv(args: argparse.Namespace, model: str) -> list[str]:
    argv = ["--model", model, "--device", args.device, "--dtype", args.dtype, "--tp", str(args.tp),
            "--kv-cache-gib", str(args.kv_cache_gib),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-num-seqs", str(args.max_num_seqs), "--max-logprobs", str(args.max_logprobs),
            "--attention-backend", args.attention_backend, "--cpu-yield", args.cpu_yield]
    if args.block_size is not None:
        argv += ["--block-size", str(args.block_size)]
    if args.threads is not None:        # serve fills it in (plan.default_threads)
        argv += ["--threads", str(args.threads)]
    if args.kv_host_gib:
        argv += ["--kv-host-gib", str(args.kv_host_gib)]
    if args.kv_disk_gib:
        argv += ["--kv-disk-gib", str(args.kv_disk_gib), "--kv-disk-path", str(args.kv_disk_path)]
    return argv


def kvstore_argv(args: argparse.Namespace, port: int) -> list[str]:
    """The shared block store `serve --kv-store-gib` starts before the workers."""
    return ["kvstore", "--capacity-gib", str(args.kv_store_gib), "--port", str(port), "--transfer", args.transfer]


def worker_argv(args: argparse.Namespace, name: str, role: str, port: int, model: str,
                cores: str | None = None, kv_store: str | None = None, etcd: str | None = None,
                metrics_port: int | None = None) -> list[str]:
    """One worker's command line; with `etcd` (HOST:PORT, `serve --autoscale`) it registers
    there once SERVING and deregisters after its drain (how the frontends learn of it); with
    `metrics_port` (`serve --worker-metrics`) it serves its Prometheus /metrics there."""
    argv = ["worker", "--role", role, "--port", str(port), "--worker-id", name, "--drain-timeout", str(DRAIN_S),
            *engine_argv(args, model)]
    if etcd:
        argv += ["--etcd", etcd]
    if metrics_port is not None:
        argv += ["--metrics-port", str(metrics_port)]
    if kv_store:
        argv += ["--kv-store", kv_store]
        if role == "both":          # the store client's own transfer (prefill/decode roles get it below)
            argv += ["--transfer", args.transfer]
    if args.kv_disk_gib:        # each worker's disk tier in a folder of its own under the given one
        argv[argv.index("--kv-disk-path") + 1] = os.path.join(args.kv_disk_path, name)
    if cores:
        argv += ["--cpu-cores", cores]
    if role != "both":
        argv += ["--transfer", args.transfer, "--remote-prefill-threshold", str(args.remote_prefill_threshold),
                 "--prefill-timeout", str(args.prefill_timeout)]
    argv += serve_child_argv(args, "worker")
    if getattr(args, "engine", "builtin") == "vllm":       # vLLM's own flags last, after --
        if role != "both":
            argv += ["--kv-connector", getattr(args, "kv_connector", "splitserve")]
        argv += ["--engine", "vllm", "--", *args.engine_args]
    return argv


def frontend_argv(args: argparse.Namespace, model: str, host: str, port: int, grpc_port: int,
                   worker_addresses: list[str], plan: list[PlannedWorker], etcd: str | None = None) -> list[str]:
    """One frontend (router replica): every replica gets every worker and builds its own index.
    With `etcd` (`serve --autoscale`) it follows the workers registered there instead of a list."""
    argv = ["--model", model, "--host", host, "--port", str(port), "--grpc-port", str(grpc_port),
            "--router", args.router, "--prefill-weight", str(args.prefill_weight),
            "--router-temperature", str(args.router_temperature),
            "--remote-prefill-threshold", str(args.remote_prefill_threshold),
            "--migration-limit", str(args.migration_limit), "--migration-wait", str(args.migration_wait),
            "--drain-timeout", str(DRAIN_S), "--generation-config", args.generation_config]
    if args.kv_tier_credit:
        argv += ["--kv-tier-credit", ",".join(f"{t}={v}" for t, v in args.kv_tier_credit.items())]
    if etcd:
        argv += ["--etcd", etcd]
    else:
        for address, worker in zip(worker_addresses, plan):
            argv += ["--worker", f"{worker.role}={address}"]
    if args.enable_auto_tool_choice:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", args.tool_call_parser]
    served_name = args.served_model_name or default_served_name(args.model)
    if served_name:
        argv += ["--served-model-name", served_name]
    return argv + serve_child_argv(args, "frontend")


def serve_child_argv(args: argparse.Namespace, child: str) -> list[str]:
    """The flags `serve` forwards to one child: "worker" or "frontend" (secrets go by environment)."""
    internal = ["--tls-ca", args.tls_ca] if args.tls_ca else []
    if args.otlp_traces_endpoint:
        internal += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    if child == "worker":
        if args.tls_internal_cert:
            internal += ["--tls-cert", args.tls_internal_cert, "--tls-key", args.tls_internal_key]
        return internal
    argv = ["--max-body-bytes", str(args.max_body_bytes), "--max-prompt-tokens", str(args.max_prompt_tokens),
            "--max-concurrent-per-key", str(args.max_concurrent_per_key), "--rate-limit", str(args.rate_limit),
            "--rate-limit-burst", str(args.rate_limit_burst), "--request-timeout", str(args.request_timeout)]
    argv += flow_control_argv(args)
    if args.api_keys_file:
        argv += ["--api-keys-file", args.api_keys_file]
    if args.tls_cert:
        argv += ["--tls-cert", args.tls_cert, "--tls-key", args.tls_key]
    if args.tls_internal_cert:
        internal += ["--tls-client-cert", args.tls_internal_cert, "--tls-client-key", args.tls_internal_key]
    return argv + internal


def flow_control_argv(args: argparse.Namespace) -> list[str]:
    """serve's --flow-control group for one frontend (checked by the cli before anything starts);
    without --max-concurrency each frontend gets its share of a worker's running batch."""
    if not getattr(args, "flow_control", False):
        return []
    share = args.max_concurrency or max(1, args.max_num_seqs // max(args.frontends, 1))
    argv = ["--flow-control", "--max-concurrency", str(share)]
    for spec in args.priority_band or []:
        argv += ["--priority-band", spec]
    if args.max_queue is not None:
        argv += ["--max-queue", str(args.max_queue)]
    if args.max_queue_wait is not None:
        argv += ["--max-queue-wait", str(args.max_queue_wait)]
    if args.fair_share is False:
        argv += ["--no-fair-share"]
    if args.fair_share_burst is not None:
        argv += ["--fair-share-burst", str(args.fair_share_burst)]
    return argv


def export_serve_secrets(args: argparse.Namespace, environ) -> None:
    """Put `serve`'s --api-key and --transfer-token values into the environment its children inherit."""
    from splitserve.services.frontend.auth import ENV_VAR

    if args.api_key:
        environ[ENV_VAR] = " ".join([*args.api_key, *environ.get(ENV_VAR, "").replace(",", " ").split()])
    if args.transfer_token:
        # Only then: the kvtransfer package imports torch, which costs `serve` most of a second.
        from splitserve.kvtransfer.auth import TOKEN_ENV

        environ[TOKEN_ENV] = args.transfer_token
