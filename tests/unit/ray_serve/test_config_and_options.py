"""ServingDeployment spec -> RayServeConfig -> Ray Serve deployment options, without Ray."""

from __future__ import annotations

import argparse

import pytest
import yaml

from splitserve.errors import SplitserveError
from splitserve.services.ray_serve.app import deployment_options
from splitserve.services.ray_serve.config import (config_from_args, config_from_spec, parse_cpu, parse_memory,
                                                  read_spec)
from splitserve.services.ray_serve.settings import EngineSettings

SPEC = {
    "model": {"source": "/models/llama", "dtype": "float32"},
    "frontend": {"replicas": 2, "port": 9000},
    "router": {"policy": "round-robin", "prefillWeight": 2.0, "temperature": 0.5},
    "prefill": {"replicas": 1, "tensorParallel": 2, "gpusPerRank": 1, "resources": {"cpu": "500m", "memory": "2Gi"}},
    "decode": {"replicas": 3, "gpusPerRank": 0, "resources": {"cpu": "2", "memory": "1Gi"},
               "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "targetOngoingRequests": 3}},
    "disaggregationThreshold": 32,
    "migrationLimit": 5,
}


def _write(tmp_path, doc) -> str:
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.mark.parametrize("doc", [SPEC, {"apiVersion": "splitserve.io/v1alpha1", "kind": "ServingDeployment",
                                        "metadata": {"name": "x"}, "spec": SPEC}])
def test_a_manifest_or_its_spec_reads_the_same(tmp_path, doc):
    spec = read_spec(_write(tmp_path, doc))
    assert spec.decode.replicas == 3 and spec.prefill.tensor_parallel == 2


def test_a_bad_spec_names_the_field(tmp_path):
    with pytest.raises(SplitserveError, match=r"spec\.decode\.replicas"):
        read_spec(_write(tmp_path, {**SPEC, "decode": {"replicas": -1}}))


def test_spec_maps_onto_pools_router_and_ingress(tmp_path):
    config = config_from_spec(read_spec(_write(tmp_path, SPEC)), EngineSettings("ignored", kv_cache_gib=0.5))
    assert config.ingress_replicas == 2 and config.http_port == 9000
    assert config.ingress.router.policy == "round-robin" and config.ingress.router.prefill_weight == 2.0
    assert config.ingress.router.remote_prefill_threshold == 32 and config.ingress.migration_limit == 5
    prefill, decode = config.prefill, config.decode
    assert prefill.worker.role == "prefill" and decode.worker.role == "decode"
    assert prefill.worker.engine.model == "/models/llama" and prefill.worker.engine.dtype == "float32"
    assert prefill.worker.engine.kv_cache_gib == 0.5
    assert prefill.worker.engine.device == "cuda" and decode.worker.engine.device == "cpu"
    assert prefill.cpus_per_rank == 0.5 and prefill.gpus_per_rank == 1.0
    assert decode.memory_bytes_per_rank == 2**30
    assert decode.worker.remote_prefill_threshold == 32


def test_no_prefill_pool_means_aggregated_workers(tmp_path):
    config = config_from_spec(read_spec(_write(tmp_path, {**SPEC, "prefill": {"replicas": 0}})))
    assert config.prefill is None and config.decode.worker.role == "both"
    assert [p.name for p in config.pools] == ["Worker"]


def test_pipeline_parallel_is_refused(tmp_path):
    with pytest.raises(SplitserveError, match="pipelineParallel"):
        config_from_spec(read_spec(_write(tmp_path, {**SPEC, "decode": {"pipelineParallel": 2}})))


def test_a_tensor_parallel_group_is_one_strict_pack_placement_group(tmp_path):
    config = config_from_spec(read_spec(_write(tmp_path, SPEC)))
    options = deployment_options(config.prefill)
    assert options["name"] == "PrefillWorker" and options["num_replicas"] == 1
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["placement_group_bundles"] == [{"CPU": 0.5, "GPU": 1.0, "memory": 2 * 2**30}] * 2
    assert options["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 1.0, "memory": 2 * 2**30}


def test_the_drain_timeout_bounds_serves_graceful_stop(tmp_path):
    config = config_from_spec(read_spec(_write(tmp_path, {**SPEC, "drainTimeoutSeconds": 45})))
    assert config.decode.worker.drain_timeout_s == 45.0
    assert deployment_options(config.decode)["graceful_shutdown_timeout_s"] > 45.0


def test_topology_none_packs_loosely(tmp_path):
    doc = {**SPEC, "prefill": {**SPEC["prefill"], "topology": {"mode": "none"}}}
    options = deployment_options(config_from_spec(read_spec(_write(tmp_path, doc))).prefill)
    assert options["placement_group_strategy"] == "PACK"


def test_autoscaling_replaces_a_fixed_count(tmp_path):
    options = deployment_options(config_from_spec(read_spec(_write(tmp_path, SPEC))).decode)
    assert "num_replicas" not in options and "placement_group_bundles" not in options
    assert options["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 3.0,
        "policy": {"policy_function": "splitserve.services.ray_serve.autoscaling:in_flight_policy"}}


def test_the_autoscaling_policy_sizes_the_pool_by_in_flight_calls():
    from splitserve.services.ray_serve.autoscaling import desired_replicas, in_flight_policy

    assert desired_replicas({"a": 6.0, "b": 3.0}, target=3.0, current=2) == 3.0
    assert desired_replicas({"a": 0.0, "b": 0.0}, target=3.0, current=2) == 0.0
    assert desired_replicas({}, target=3.0, current=2) == 2.0          # nothing reported yet: hold
    assert in_flight_policy.__module__ + ":" + in_flight_policy.__name__ == \
        "splitserve.services.ray_serve.autoscaling:in_flight_policy"


def test_the_version_ignores_the_replica_count(tmp_path):
    """Scaling through the config must not restart workers: the version depends on what a
    replica is built with, never on how many there are."""
    def options(replicas: int, kv: float = 0.5) -> dict:
        doc = {**SPEC, "prefill": {**SPEC["prefill"], "replicas": replicas}}
        config = config_from_spec(read_spec(_write(tmp_path, doc)), EngineSettings("m", kv_cache_gib=kv))
        return deployment_options(config.prefill)

    assert options(1)["version"] == options(5)["version"]
    assert options(1)["version"] != options(1, kv=0.25)["version"]


def test_quantities():
    assert parse_cpu("250m") == 0.25 and parse_cpu("3") == 3.0
    assert parse_memory("512Mi") == 512 * 2**20 and parse_memory("1G") == 10**9 and parse_memory("1024") == 1024
    with pytest.raises(SplitserveError):
        parse_cpu("lots")


def test_serve_flags_map_like_splitserve_serve():
    from splitserve.services.cli.parsers import build_parser

    args = build_parser().parse_args(["serve", "--on-ray", "--model", "/m", "--prefill-workers", "2",
                                      "--decode-workers", "3", "--router", "least-loaded", "--kv-cache-gib", "0.1"])
    assert isinstance(args, argparse.Namespace)
    config = config_from_args(args)
    assert config.prefill.replicas == 2 and config.decode.replicas == 3
    assert config.ingress.router.policy == "least-loaded" and config.decode.worker.engine.kv_cache_gib == 0.1
    assert config.http_port == 8000 and config.ingress_replicas == 1
    assert config.ingress.tool_call_parser is None
    tools = build_parser().parse_args(["serve", "--on-ray", "--model", "/m", "--enable-auto-tool-choice",
                                       "--tool-call-parser", "hermes"])
    assert config_from_args(tools).ingress.tool_call_parser == "hermes"


def test_security_flags_are_refused_not_ignored():
    from splitserve.services.cli.parsers import build_parser

    args = build_parser().parse_args(["serve", "--on-ray", "--model", "/m", "--api-key", "secret"])
    with pytest.raises(SplitserveError, match="--api-key"):
        config_from_args(args)


def test_a_vllm_pool_runs_vllm_workers_with_its_engine_args(tmp_path):
    doc = {**SPEC, "engine": "vllm", "prefill": {"replicas": 0},
           "decode": {"replicas": 1, "engineArgs": ["--max-model-len", "2048"]}}
    config = config_from_spec(read_spec(_write(tmp_path, doc)), migration_wait_s=120.0)
    engine = config.decode.worker.engine
    assert (engine.engine, engine.engine_args, engine.block_size) == ("vllm", ("--max-model-len", "2048"), None)
    assert config.decode.worker.role == "both" and config.prefill is None
    assert config.ingress.migration_wait_s == 120.0


def test_a_vllm_replica_starts_the_vllm_worker_with_its_flags_after_the_separator(tmp_path):
    from splitserve.services.ray_serve.settings import WorkerSettings
    from splitserve.services.ray_serve.worker_process import worker_argv

    engine = EngineSettings(model=str(tmp_path), kv_cache_gib=2, block_size=None, engine="vllm",
                            engine_args=("--max-model-len", "2048"))
    argv = worker_argv(WorkerSettings(role="both", engine=engine), "both-x", "10.0.0.5", 5000)
    assert argv[:3] == ["worker", "--engine", "vllm"]
    assert argv[argv.index("--host") + 1] == "10.0.0.5" and argv[argv.index("--port") + 1] == "5000"
    assert "--block-size" not in argv and argv[argv.index("--kv-cache-gib") + 1] == "2"
    assert argv[argv.index("--"):] == ["--", "--max-model-len", "2048"]
    # ...parsed as `splitserve worker` parses it
    from splitserve.services.cli.parsers import build_parser

    args = build_parser().parse_args(argv)
    assert args.engine == "vllm" and args.engine_args == ["--max-model-len", "2048"]


def test_serve_on_ray_with_engine_vllm_plans_vllm_workers(tmp_path):
    from splitserve.services.cli.commands import _check_vllm_serve
    from splitserve.services.cli.parsers import build_parser

    args = build_parser().parse_args(["serve", "--on-ray", "--engine", "vllm", "--engine-python", "/py",
                                      "--model", "smollm2", "--workers", "1", "--migration-wait", "90",
                                      "--", "--max-model-len", "2048"])
    _check_vllm_serve(args)
    config = config_from_args(args)
    engine = config.decode.worker.engine
    assert config.prefill is None and config.decode.worker.role == "both" and config.decode.replicas == 1
    assert (engine.engine, engine.engine_python, engine.engine_args) == ("vllm", "/py", ("--max-model-len", "2048"))
    assert engine.block_size is None and config.ingress.migration_wait_s == 90


def test_tracing_reaches_the_ingress_and_every_worker_replica(tmp_path):
    """The spec's tracing.otlpTracesEndpoint, else `serve --on-ray --otlp-traces-endpoint`."""
    from splitserve.services.cli.parsers import build_parser
    from splitserve.services.ray_serve.worker import _server_config
    from splitserve.services.ray_serve.worker_process import worker_argv

    def endpoints(config):
        pools = [p for p in (config.prefill, config.decode) if p is not None]
        return {config.ingress.otlp_traces_endpoint, *(p.worker.otlp_traces_endpoint for p in pools)}

    traced = {**SPEC, "tracing": {"otlpTracesEndpoint": "http://otel:4317"}}
    assert endpoints(config_from_spec(read_spec(_write(tmp_path, traced)))) == {"http://otel:4317"}
    assert endpoints(config_from_spec(read_spec(_write(tmp_path, SPEC)))) == {None}
    assert endpoints(config_from_spec(read_spec(_write(tmp_path, SPEC)),
                                      otlp_traces_endpoint="http://flag:4317")) == {"http://flag:4317"}
    args = build_parser().parse_args(["serve", "--on-ray", "--model", "/m", "--otlp-traces-endpoint", "http://f:4317"])
    config = config_from_args(args)
    assert endpoints(config) == {"http://f:4317"}
    # A built-in replica's worker server, and a vLLM replica's child process, get it.
    assert _server_config(config.decode.worker, "decode-x", "127.0.0.1", 5000).options.otlp_traces_endpoint \
        == "http://f:4317"
    vllm = EngineSettings(model=str(tmp_path), engine="vllm", block_size=None)
    from splitserve.services.ray_serve.settings import WorkerSettings

    argv = worker_argv(WorkerSettings(role="both", engine=vllm, otlp_traces_endpoint="http://f:4317"), "b", "h", 1)
    assert build_parser().parse_args(argv).otlp_traces_endpoint == "http://f:4317"
    assert "--otlp-traces-endpoint" not in worker_argv(WorkerSettings(role="both", engine=vllm), "b", "h", 1)


def test_the_specs_weights_revision_names_every_workers_weights(tmp_path, monkeypatch):
    """spec.model.revision on Ray as on Kubernetes: the built-in worker's engine config carries it,
    a vLLM replica's child process gets it as SPLITSERVE_WEIGHTS_REVISION; unset, neither."""
    from splitserve.services.ray_serve.worker import _server_config
    from splitserve.services.ray_serve.worker_process import worker_env

    monkeypatch.delenv("SPLITSERVE_WEIGHTS_REVISION", raising=False)
    named = {**SPEC, "model": {**SPEC["model"], "revision": "llama-r7"}}
    config = config_from_spec(read_spec(_write(tmp_path, named)))
    for pool in (config.prefill, config.decode):
        assert pool.worker.engine.weights_revision == "llama-r7"
    assert _server_config(config.decode.worker, "d0", "127.0.0.1", 1).engine.config.weights_revision == "llama-r7"
    assert worker_env(config.decode.worker)["SPLITSERVE_WEIGHTS_REVISION"] == "llama-r7"
    plain = config_from_spec(read_spec(_write(tmp_path, SPEC)))
    assert plain.decode.worker.engine.weights_revision == ""
    assert "SPLITSERVE_WEIGHTS_REVISION" not in worker_env(plain.decode.worker)
