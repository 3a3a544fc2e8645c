"""What each `splitserve` command does with its parsed flags: build the service's typed config and
hand it over. Every service is imported inside its command, so `splitserve frontend` never
loads the engine and `--help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging

from splitserve.errors import SplitserveError
from splitserve.services.cli import security as _security_args
from splitserve.services.cli.flow_control_args import flow_control_settings


def _engine_config(args: argparse.Namespace):
    from splitserve.services.engine.config import EngineConfig
    from splitserve.services.engine.cpu_placement import parse_cores

    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                        tensor_parallel_size=args.tp, block_size=args.block_size or 16,
                        kv_cache_gib=args.kv_cache_gib,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=args.max_num_seqs, max_logprobs=args.max_logprobs, num_threads=args.threads,
                        cpu_cores=parse_cores(args.cpu_cores) if args.cpu_cores else None,
                        cpu_yield=args.cpu_yield == "auto",
                        attention_backend=args.attention_backend, kv_host_gib=args.kv_host_gib,
                        kv_disk_gib=args.kv_disk_gib, kv_disk_path=args.kv_disk_path)


def cmd_generate(args: argparse.Namespace) -> int:
    from splitserve.services.engine.engine import LLMEngine
    from splitserve.services.text.generate import generate_text
    from splitserve.services.worker_protocol.sampling_params import SamplingParams

    if not args.prompt and not args.prompt_ids:
        raise SplitserveError("give at least one --prompt or --prompt-ids")
    engine = LLMEngine(_engine_config(args))
    try:
        prompts: list[list[int]] = []
        for text in args.prompt or []:
            if args.chat:
                prompts.append(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]))
            else:
                prompts.append(engine.tokenizer.encode(text))
        prompts.extend(args.prompt_ids or [])
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                ignore_eos=args.ignore_eos)
        for result in generate_text(engine, prompts, params):    # the text as the frontend makes it
            if args.json:
                print(json.dumps({"token_ids": result.token_ids, "text": result.text,
                                  "finish_reason": result.finish_reason.value,
                                  "num_prompt_tokens": result.num_prompt_tokens}), flush=True)
            else:
                print(result.text, flush=True)
    finally:
        engine.close()
    return 0


def _group_engine_config(args: argparse.Namespace):
    """The engine config, and this process's place in a group of ranks started one by one
    (SPLITSERVE_TP_* in the environment; None: `--tp N` starts its ranks locally)."""
    import os
    from dataclasses import replace

    from splitserve.services.engine.parallel.rendezvous import ENV_WORLD_SIZE, GroupMember

    engine = _engine_config(args)
    member = GroupMember.from_env(os.environ)
    if member is None:
        return engine, None
    if args.tp not in (1, member.world_size):
        raise SplitserveError(f"--tp {args.tp} contradicts {ENV_WORLD_SIZE}={member.world_size}")
    return replace(engine, tensor_parallel_size=member.world_size, tp_leader=member.leader,
                   tp_join_timeout_s=member.join_timeout_s), member


def _vllm_launcher(args: argparse.Namespace):
    """`worker --engine vllm`: vLLM in this process; a prefill or decode worker loads splitserve's KV
    connector into it."""
    from splitserve.services.engine_vllm.launcher import VllmEngineLauncher, WorkerEngineFlags

    if args.role != "both" and args.tp > 1:
        raise SplitserveError(f"--role {args.role} with --engine vllm needs --tp 1 for now: vLLM runs its other "
                              "tensor-parallel ranks in processes of their own, which splitserve's KV connector "
                              "does not reach yet")
    if args.kv_store:
        raise SplitserveError("--kv-store is not available with --engine vllm (vLLM keeps its own KV cache)")
    flags = WorkerEngineFlags(model=args.model, device=args.device, dtype=args.dtype, tp=args.tp,
                              block_size=args.block_size, kv_cache_gib=args.kv_cache_gib,
                              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                              max_logprobs=args.max_logprobs, cpu_cores=vllm_rank_cores(args.cpu_cores, args.tp),
                              pinned_cores=vllm_pinned_cores(args.cpu_cores))
    return VllmEngineLauncher(flags, list(args.engine_args),
                              kv_connector=args.kv_connector if args.role != "both" else "",
                              side_channel_host=_reachable_host(args))


def _reachable_host(args: argparse.Namespace) -> str:
    """Where other workers reach this one: --advertise-host, else --host unless it is a wildcard."""
    from splitserve.services.worker.server import WILDCARD_HOSTS

    if args.advertise_host:
        return args.advertise_host
    return "127.0.0.1" if args.host in WILDCARD_HOSTS else args.host


def vllm_pinned_cores(cpu_cores: str | None) -> tuple[int, ...]:
    if cpu_cores is None:
        return ()
    from splitserve.services.engine.cpu_placement import parse_cores

    return parse_cores(cpu_cores)


def vllm_rank_cores(cpu_cores: str | None, tp: int) -> str | None:
    """--cpu-cores in VLLM_CPU_OMP_THREADS_BIND's syntax: one list per rank, joined by '|'."""
    if cpu_cores is None or tp <= 1:
        return cpu_cores
    from splitserve.services.engine.cpu_placement import format_cores, parse_cores, rank_cores

    cores = parse_cores(cpu_cores)
    return "|".join(format_cores(rank_cores(cores, tp, rank)) for rank in range(tp))


def _builtin_launcher(args: argparse.Namespace):
    """The built-in engine's launcher, and this process's place in a group of ranks started one by one."""
    if args.engine_args:
        raise SplitserveError(f"engine flags after -- ({' '.join(args.engine_args)}) are for --engine vllm")
    _check_kv_connector(args)
    from splitserve.services.engine.builtin import BuiltinEngineLauncher

    engine, member = _group_engine_config(args)
    if args.kv_store:
        _check_kv_store(True, engine.tensor_parallel_size)
    return BuiltinEngineLauncher(engine), member


def cmd_worker(args: argparse.Namespace) -> int:
    import asyncio

    from splitserve.services.worker.server import WorkerServerConfig, registered_host, serve
    from splitserve.services.worker.service import Role, WorkerOptions

    if args.kv_store == "etcd" and not etcd_endpoints(args.etcd):
        raise SplitserveError("--kv-store etcd needs --etcd (where the store registered)")
    _check_kv_faults()
    if args.engine == "vllm":
        launcher = _vllm_launcher(args)
    else:
        launcher, member = _builtin_launcher(args)
        if member is not None and member.rank > 0:     # no gRPC API: serves rank 0's steps
            from splitserve.services.engine.parallel.tensor_parallel import run_member

            return run_member(member, launcher.config, args.host, args.advertise_host)
    role = Role(args.role)
    options = WorkerOptions(worker_id=args.worker_id or f"{role.value}-{args.port}", role=role,
                            remote_prefill_threshold=args.remote_prefill_threshold,
                            prefill_timeout_s=args.prefill_timeout)
    options.otlp_traces_endpoint = _tracing_endpoint(args)
    config = WorkerServerConfig(options=options, engine=launcher, host=args.host,
                                advertise_host=args.advertise_host,
                                port=args.port, transfer=args.transfer, etcd=etcd_endpoints(args.etcd),
                                etcd_prefix=args.etcd_prefix, etcd_ttl_s=args.etcd_ttl,
                                drain_timeout_s=args.drain_timeout, metrics_port=args.metrics_port,
                                session_port=None if args.session_port < 0 else args.session_port,
                                kv_store=args.kv_store)
    _apply_worker_security(config, args)
    if config.etcd:
        registered_host(config)          # refuse a wildcard with nothing to register before loading
    return asyncio.run(serve(config))


def cmd_kvstore(args: argparse.Namespace) -> int:
    import asyncio

    from splitserve.kvtransfer.auth import token_from
    from splitserve.services.kvstore.server import KVStoreConfig, serve

    if args.capacity_gib <= 0:
        raise SplitserveError("--capacity-gib must be > 0")
    config = KVStoreConfig(capacity_gib=args.capacity_gib, host=args.host, port=args.port,
                           advertise_host=args.advertise_host, transfer=args.transfer,
                           transfer_token=token_from(args.transfer_token),
                           fault_fetch_delay_s=args.fault_fetch_delay, etcd=etcd_endpoints(args.etcd),
                           etcd_tls=_security_args.etcd_tls(args), metrics_port=args.metrics_port)
    return asyncio.run(serve(config))


def cmd_frontend(args: argparse.Namespace) -> int:
    from splitserve.services.frontend.server import FrontendConfig, run_frontend

    if not args.worker and not etcd_endpoints(args.etcd):
        raise SplitserveError("give the workers (--worker ROLE=HOST:PORT) or an etcd to find them in (--etcd)")
    config = FrontendConfig(model=args.model, workers=args.worker or [], host=args.host, port=args.port,
                            grpc_port=args.grpc_port, served_model_name=args.served_model_name,
                            router=args.router, prefill_router=args.prefill_router, router_seed=args.router_seed,
                            prefill_weight=args.prefill_weight, router_temperature=args.router_temperature,
                            kv_tier_credit=args.kv_tier_credit,
                            remote_prefill_threshold=args.remote_prefill_threshold, etcd=etcd_endpoints(args.etcd),
                            etcd_prefix=args.etcd_prefix)
    config.migration_limit, config.drain_timeout_s = args.migration_limit, args.drain_timeout
    config.migration_wait_s = args.migration_wait
    config.generation_config = args.generation_config
    config.tool_call_parser = check_tool_args(args)
    config.otlp_traces_endpoint = _tracing_endpoint(args)
    config.flow_control = flow_control_settings(args)
    config.gateway = args.gateway
    if args.gateway and any(w.partition("=")[0] == "prefill" for w in args.worker or []):
        raise SplitserveError("--gateway: the endpoint picker names the prefill worker (header x-prefiller-host-port); "
                              "give only this pod's decode worker with --worker")
    _apply_frontend_security(config, args)
    # uvloop: about a quarter of a millisecond less added latency per request, and less CPU
    # (bench/serving.py, frontend overhead).
    return _run_fast(run_frontend(config))


def cmd_epp(args: argparse.Namespace) -> int:
    from splitserve.services.cli import security as sec
    from splitserve.services.epp.objectives import parse_objective_flag
    from splitserve.services.epp.server import EppConfig, run_epp
    from splitserve.services.frontend.limits import LimitsConfig
    from splitserve.services.frontend.server import FrontendConfig

    sources = [bool(args.pool_name), bool(args.worker), bool(etcd_endpoints(args.etcd))]
    if sum(sources) != 1:
        raise SplitserveError("give the workers one way: --pool-name (an InferencePool's pods), --worker ROLE=HOST:PORT, "
                              "or --etcd")
    if args.fallbacks < 0 or args.max_body_bytes < 1:
        raise SplitserveError("--fallbacks must be >= 0 and --max-body-bytes >= 1")
    frontend = FrontendConfig(model=args.model, workers=args.worker or [], host=args.host,
                              served_model_name=args.served_model_name, router=args.router,
                              prefill_router=args.prefill_router, prefill_weight=args.prefill_weight,
                              router_temperature=args.router_temperature, kv_tier_credit=args.kv_tier_credit,
                              remote_prefill_threshold=args.remote_prefill_threshold, etcd=etcd_endpoints(args.etcd),
                              etcd_prefix=args.etcd_prefix)
    frontend.tool_call_parser = check_tool_args(args)
    frontend.limits = LimitsConfig(max_prompt_tokens=args.max_prompt_tokens)
    frontend.worker_tls, frontend.etcd_tls = sec.frontend_worker_tls(args), sec.etcd_tls(args)
    frontend.flow_control = flow_control_settings(args)
    objectives = [parse_objective_flag(text) for text in args.objective]
    if objectives and frontend.flow_control is None:
        raise SplitserveError("--objective sets a priority for flow control: add --flow-control")
    config = EppConfig(frontend, port=args.port, objectives=objectives, health_port=args.health_port,
                       metrics_port=None if args.metrics_port < 0 else args.metrics_port,
                       pool_name=args.pool_name, pool_namespace=args.pool_namespace, target_port=args.target_port,
                       endpoints=args.endpoint, fallbacks=args.fallbacks, max_body_bytes=args.max_body_bytes,
                       tls=sec.public_tls(args), drain_timeout_s=args.drain_timeout)
    return _run_fast(run_epp(config))


def _run_fast(main):
    """asyncio.run on uvloop where it exists (it does not on Windows)."""
    import asyncio

    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _apply_worker_security(config, args: argparse.Namespace) -> None:
    from splitserve.kvtransfer.auth import token_from
    from splitserve.services.cli import security as sec

    config.options.tls = sec.worker_tls(args)
    config.etcd_tls = sec.etcd_tls(args)
    config.transfer_token = token_from(args.transfer_token)


def _apply_frontend_security(config, args: argparse.Namespace) -> None:
    from splitserve.services.cli import security as sec
    from splitserve.services.frontend.auth import ApiKeys

    config.api_keys = ApiKeys.load(args.api_key, args.api_keys_file)
    config.limits = sec.limits_config(args)
    config.tls, config.worker_tls = sec.public_tls(args), sec.frontend_worker_tls(args)
    config.etcd_tls = sec.etcd_tls(args)


def _check_kv_store(wanted: bool | None, tp: int) -> None:
    if wanted is None:
        raise SplitserveError("--kv-store-gib must be >= 0")
    if wanted and tp > 1:
        raise SplitserveError("the shared KV store needs --tp 1 for now: it holds whole blocks, not one "
                              "rank's share of the KV heads")


def _check_kv_connector(args: argparse.Namespace) -> None:
    if getattr(args, "kv_connector", "splitserve") != "splitserve":
        raise SplitserveError(f"--kv-connector {args.kv_connector} is vLLM's connector: it needs --engine vllm "
                              "(the built-in engine moves KV with splitserve's connector only)")


def _check_vllm_serve(args: argparse.Namespace) -> None:
    """`serve --engine vllm`: aggregated workers unless a prefill or decode pool is asked for, and
    refusals for what vLLM workers lack yet."""
    if args.engine != "vllm":
        if args.engine_args:
            raise SplitserveError(f"engine flags after -- ({' '.join(args.engine_args)}) are for --engine vllm")
        _check_kv_connector(args)
        return
    disaggregated = args.prefill_workers is not None or args.decode_workers is not None
    if disaggregated and args.tp > 1:
        raise SplitserveError("disaggregated serving with --engine vllm needs --tp 1 for now: vLLM runs its other "
                              "tensor-parallel ranks in processes of their own, which splitserve's KV connector "
                              "does not reach yet")
    if args.kv_store_gib > 0:
        raise SplitserveError("--kv-store-gib is not available with --engine vllm yet")
    if args.autoscale:
        # The planner may switch to disaggregated serving only where workers can take a prefill or
        # decode role; a vLLM worker serves aggregated only, so its autoscaler sizes one pool.
        if getattr(args, "autoscale_mode", None) == "auto":
            raise SplitserveError("--autoscale-mode auto with --engine vllm: the planner's switch between "
                                  "aggregated and disaggregated serving is not available with vLLM workers yet; "
                                  "use --autoscale-mode fixed (the default with --engine vllm)")
        args.autoscale_mode = "fixed"
    if not disaggregated:
        args.aggregated = True


def _check_kv_faults() -> None:
    """A bad SPLITSERVE_KV_FAULTS is an error at start, not in the middle of a transfer."""
    from splitserve.kvtransfer.faults import FaultSpecError, FaultSwitch

    try:
        switch = FaultSwitch.from_env()
    except FaultSpecError as exc:
        raise SplitserveError(f"SPLITSERVE_KV_FAULTS: {exc}") from None
    if switch.armed:
        logging.getLogger(__name__).warning("KV fault injection is on (%s): blocks will be damaged on purpose",
                                            ", ".join(f"{k}={v.kind}@{v.rate:g}" for k, v in switch.fixed.items())
                                            or switch.path)


def cmd_serve(args: argparse.Namespace) -> int:
    check_tool_args(args)
    _check_kv_faults()
    _check_vllm_serve(args)
    if args.kv_store_gib and args.on_ray:
        raise SplitserveError("--kv-store-gib is not available on Ray yet; run `splitserve kvstore` yourself")
    if flow_control_settings(args) is not None and args.on_ray:
        raise SplitserveError("--flow-control is not available on Ray yet: the Ray Serve ingress takes no "
                              "flow-control settings")
    if args.autoscale and args.on_ray:
        raise SplitserveError("--autoscale starts and drains local worker processes; it does not apply with "
                              "--on-ray (scale Ray Serve's deployments with Ray's own autoscaling)")
    if args.on_ray:
        from splitserve.services.ray_serve.launch import run_on_ray

        args.otlp_traces_endpoint = _tracing_endpoint(args)      # every replica gets it
        return run_on_ray(args)
    if args.config or args.ray_address:
        raise SplitserveError("--config and --ray-address are for --on-ray")
    from splitserve.services.launch.local import run_serve

    _security_args.check_serve_args(args)
    args.otlp_traces_endpoint = _tracing_endpoint(args)      # every child gets the flag
    _check_kv_store(args.kv_store_gib > 0 if args.kv_store_gib >= 0 else None, args.tp)
    return run_serve(args)


def _tracing_endpoint(args: argparse.Namespace) -> str | None:
    """--otlp-traces-endpoint, else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; refused at once when given
    but OpenTelemetry is not installed."""
    from splitserve.tracing import require_tracing, resolve_endpoint

    endpoint = resolve_endpoint(args.otlp_traces_endpoint)
    if endpoint:
        require_tracing()
    return endpoint


def check_tool_args(args: argparse.Namespace) -> str | None:
    """The parser of tool_choice="auto" (None: auto is refused); vLLM's rule for the two flags."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SplitserveError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
    return args.tool_call_parser if args.enable_auto_tool_choice else None


def cmd_bench(args: argparse.Namespace) -> int:
    from splitserve.loadgen.cli import main as bench_main

    return bench_main(args.bench_args)


def cmd_operator(args: argparse.Namespace) -> int:
    import os

    from splitserve.operator.runner import OperatorOptions, run_operator

    options = OperatorOptions.from_flags(
        kubeconfig=args.kubeconfig, namespaces=args.namespace, all_namespaces=args.all_namespaces,
        etcd_endpoint=args.etcd_endpoint, interval_s=args.interval, worker_address=args.worker_address,
        node_grace_s=args.node_grace, leader_election_namespace=args.leader_election_namespace,
        health_port=args.health_port, etcd_tls_secret=args.etcd_tls_secret)
    if os.environ.get("SPLITSERVE_LOG_LEVEL") and args.log_level == "WARNING":   # the chart's, unless a flag
        logging.getLogger().setLevel(os.environ["SPLITSERVE_LOG_LEVEL"].upper())
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        from splitserve.operator.scaling_task import decision_metrics

        decision_metrics()           # registered before the first scrape
        start_http_server(args.metrics_port, "0.0.0.0")
    return run_operator(options)


def etcd_endpoints(values: list[str] | None) -> list[str]:
    """`--etcd` values, each one endpoint or a comma-separated list (the operator's ConfigMap
    gives every member in one), as host:port (a scheme such as http:// is dropped)."""
    return [e.strip().split("://")[-1] for value in values or [] for e in value.split(",") if e.strip()]
