"""Pure builders: worker pods carry rank, world size, leader, scheduler; children are owned."""

from __future__ import annotations

import yaml

from splitserve.operator import builders, names
from splitserve.operator.builders import Owner
from splitserve.services.spec.serving_deployment import ServingDeploymentSpec

OWNER = Owner("llm", "prod", "uid-7")
SPEC = ServingDeploymentSpec.from_dict({
    "model": {"source": "smollm2"},
    "prefill": {"tensorParallel": 2, "pipelineParallel": 2, "gpusPerRank": 2,
                "topology": {"mode": "same-label", "labelKey": "zone"}},
})


def env(pod):
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def test_group_pods_carry_rank_world_size_and_leader():
    pods = builders.build_group_pods(OWNER, SPEC, "prefill", "llm-prefill-abc12")
    assert [p["metadata"]["name"] for p in pods] == [f"llm-prefill-abc12-{r}" for r in range(4)]
    leader = "llm-prefill-abc12-0.llm-workers.prod.svc.cluster.local"
    for rank, pod in enumerate(pods):
        meta, spec = pod["metadata"], pod["spec"]
        assert meta["labels"][names.LABEL_RANK] == str(rank)
        assert meta["labels"][names.LABEL_GROUP] == "llm-prefill-abc12"
        assert meta["labels"][names.LABEL_ROLE] == "prefill"
        assert meta["labels"][names.LABEL_DEPLOYMENT] == "llm"
        assert meta["annotations"][names.ANN_GROUP_SIZE] == "4"
        assert meta["annotations"][names.ANN_TOPOLOGY] == "same-label=zone"
        assert meta["ownerReferences"][0]["uid"] == "uid-7" and meta["ownerReferences"][0]["controller"]
        assert spec["schedulerName"] == "splitserve-gang" and spec["restartPolicy"] == "Never"
        assert spec["subdomain"] == "llm-workers" and spec["hostname"] == meta["name"]
        e = env(pod)
        assert e["SPLITSERVE_TP_RANK"] == str(rank) and e["SPLITSERVE_TP_WORLD_SIZE"] == "4"
        assert e["SPLITSERVE_TP_LEADER"] == f"{leader}:{names.DIST_PORT}"
        container = pod["spec"]["containers"][0]
        assert container["resources"]["requests"][names.GPU_RESOURCE] == "2"
        assert ("readinessProbe" in container) == (rank == 0)
    probe = pods[0]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
    assert probe[:3] == ["python", "-m", "splitserve.operator.probe"]


def test_every_worker_rank_serves_metrics_on_a_named_port():
    for rank, pod in enumerate(builders.build_group_pods(OWNER, SPEC, "prefill", "llm-prefill-abc12")):
        container = pod["spec"]["containers"][0]
        args = container["args"]
        assert args[args.index("--metrics-port") + 1] == str(names.WORKER_METRICS_PORT), rank
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"grpc": names.WORKER_PORT, "dist": names.DIST_PORT, "metrics": names.WORKER_METRICS_PORT,
                         "session": names.WORKER_SESSION_PORT}
        assert len(set(ports.values())) == len(ports)
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(names.WORKER_METRICS_PORT)
        assert annotations["prometheus.io/path"] == "/metrics"
    frontend = builders.build_frontend_deployment(OWNER, SPEC)["spec"]["template"]["metadata"]["annotations"]
    assert frontend["prometheus.io/port"] == "8000"


def test_worker_args_parse_with_the_worker_cli():
    """What the operator passes is what `splitserve worker` accepts (its own parser, no process)."""
    from splitserve.services.cli.parsers import build_parser

    pod = builders.build_worker_pod(OWNER, SPEC, "decode", "g0", 0)["spec"]["containers"][0]
    assert pod["command"] == ["splitserve"]          # the image's ENTRYPOINT too (deploy/image/Dockerfile)
    parsed = build_parser().parse_args(pod["args"])
    assert parsed.command == "worker" and parsed.role == "decode"
    assert (parsed.host, parsed.advertise_host) == ("0.0.0.0", "$(POD_IP)")
    assert parsed.metrics_port == names.WORKER_METRICS_PORT and parsed.port == names.WORKER_PORT
    assert parsed.session_port == names.WORKER_SESSION_PORT


def test_engine_args_reach_the_worker_and_roll_the_pool():
    from splitserve.services.cli.parsers import build_parser

    tuned = ServingDeploymentSpec.from_dict({**SPEC.to_dict(), "decode": {
        **SPEC.decode.to_dict(), "engineArgs": ["--kv-cache-gib", "0.25", "--threads=1"]}})
    assert ServingDeploymentSpec.from_dict(tuned.to_dict()) == tuned
    args = builders.build_worker_pod(OWNER, tuned, "decode", "g0", 0)["spec"]["containers"][0]["args"]
    assert args[-3:] == ["--kv-cache-gib", "0.25", "--threads=1"]
    parsed = build_parser().parse_args(args)
    assert (parsed.kv_cache_gib, parsed.threads, parsed.role) == (0.25, 1, "decode")
    assert builders.pool_spec_hash(tuned, "decode") != builders.pool_spec_hash(SPEC, "decode")
    assert builders.pool_spec_hash(tuned, "prefill") == builders.pool_spec_hash(SPEC, "prefill")


def test_the_flags_engine_args_may_not_set_are_every_flag_the_operator_sets():
    from splitserve.services.spec.serving_deployment import OPERATOR_WORKER_FLAGS

    tls = builders.WorkloadOptions(etcd_tls_secret="etcd-client")
    args = builders.build_worker_pod(OWNER, SPEC, "decode", "g0", 0, tls)["spec"]["containers"][0]["args"]
    assert sorted(a for a in args if a.startswith("--")) == sorted(OPERATOR_WORKER_FLAGS)


def test_spec_hash_ignores_replicas_but_not_image():
    scaled = ServingDeploymentSpec.from_dict({**SPEC.to_dict(), "prefill": {**SPEC.prefill.to_dict(), "replicas": 5}})
    assert builders.pool_spec_hash(scaled, "prefill") == builders.pool_spec_hash(SPEC, "prefill")
    moved = ServingDeploymentSpec.from_dict({**SPEC.to_dict(), "image": "x:2"})
    assert builders.pool_spec_hash(moved, "prefill") != builders.pool_spec_hash(SPEC, "prefill")


def test_frontend_and_config_map():
    deployment = builders.build_frontend_deployment(OWNER, SPEC)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["splitserve"] and args[0] == "frontend"
    assert "--router" in args and "kv" in args
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in deployment["spec"]["selector"]["matchLabels"].items())
    service = builders.build_frontend_service(OWNER, SPEC)
    assert service["spec"]["type"] == "ClusterIP" and service["spec"]["ports"][0]["port"] == 8000
    config = builders.build_config_map(OWNER, SPEC, ["etcd:2379"])
    document = yaml.safe_load(config["data"]["servingdeployment.yaml"])
    assert ServingDeploymentSpec.from_resource(document) == SPEC
    assert config["data"]["etcd"] == "etcd:2379"


def test_the_pods_get_every_etcd_endpoint():
    """The ConfigMap's etcd key feeds the pods' `--etcd $(SPLITSERVE_ETCD)`; the worker and the
    frontend read the whole list back from that one flag value."""
    from splitserve.services.cli.commands import etcd_endpoints
    from splitserve.services.cli.parsers import build_parser

    members = ["etcd-0.etcd:2379", "etcd-1.etcd:2379", "etcd-2.etcd:2379"]
    value = builders.build_config_map(OWNER, SPEC, members)["data"]["etcd"]
    frontend = builders.build_frontend_deployment(OWNER, SPEC)["spec"]["template"]["spec"]
    worker = builders.build_worker_pod(OWNER, SPEC, "decode", "g0", 0)["spec"]
    for pod in (frontend, worker):
        args = pod["containers"][0]["args"]
        assert args[args.index("--etcd") + 1] == "$(SPLITSERVE_ETCD)"
    for command in (["frontend"], ["worker"]):
        parsed = build_parser().parse_args([*command, "--etcd", value])
        assert etcd_endpoints(parsed.etcd) == members
    assert etcd_endpoints(["http://a:1", "b:2,c:3"]) == ["a:1", "b:2", "c:3"]


def test_long_names_are_truncated_uniquely():
    a, b = names.truncate("x" * 80 + "a"), names.truncate("x" * 80 + "b")
    assert len(a) == len(b) == 63 and a != b
    assert len(names.new_group_name("y" * 70, "prefill")) <= 60


def test_etcd_client_tls_is_mounted_into_every_worker_and_frontend_pod():
    workload = builders.WorkloadOptions(etcd_tls_secret="etcd-client")
    pods = [builders.build_frontend_deployment(OWNER, SPEC, workload)["spec"]["template"]["spec"],
            *(pod["spec"] for pod in builders.build_group_pods(OWNER, SPEC, "prefill", "g1", workload))]
    for pod in pods:
        container = pod["containers"][0]
        assert {"name": "etcd-tls", "secret": {"secretName": "etcd-client"}} in pod["volumes"]
        assert {"name": "etcd-tls", "mountPath": builders.ETCD_TLS_MOUNT, "readOnly": True} in container["volumeMounts"]
        args = container["args"]
        for flag, file in (("--etcd-ca", "ca.crt"), ("--etcd-cert", "tls.crt"), ("--etcd-key", "tls.key")):
            assert args[args.index(flag) + 1] == f"{builders.ETCD_TLS_MOUNT}/{file}"
    plain = builders.build_worker_pod(OWNER, SPEC, "decode", "g0", 0)
    assert "volumes" not in plain["spec"] and "--etcd-ca" not in plain["spec"]["containers"][0]["args"]


def test_a_single_rank_group_gets_no_group_environment():
    spec = ServingDeploymentSpec.from_dict({**SPEC.to_dict(), "decode": {**SPEC.decode.to_dict(), "tensorParallel": 1,
                                                                       "pipelineParallel": 1}})
    [pod] = builders.build_group_pods(OWNER, spec, "decode", "g0")
    assert not [name for name in env(pod) if name.startswith("SPLITSERVE_TP_")]
    assert env(pod)["POD_IP"] is None            # from the downward API: status.podIP


VLLM = ServingDeploymentSpec.from_dict({
    "model": {"source": "/models/qwen", "dtype": "bfloat16"}, "engine": "vllm", "vllmImage": "example/ss:1-vllm",
    "prefill": {"replicas": 0},
    "decode": {"replicas": 2, "tensorParallel": 4, "gpusPerRank": 1, "workerArgs": ["--kv-cache-gib", "8"],
               "engineArgs": ["--quantization", "fp8", "--max-model-len=8192"]},
})


def test_a_vllm_group_is_one_pod_with_every_ranks_gpus_and_the_vllm_image():
    [pod] = builders.build_group_pods(OWNER, VLLM, "decode", "llm-decode-abc12")
    container = pod["spec"]["containers"][0]
    assert pod["metadata"]["annotations"][names.ANN_GROUP_SIZE] == "1"
    assert container["resources"]["requests"][names.GPU_RESOURCE] == "4"
    assert container["resources"]["limits"][names.GPU_RESOURCE] == "4"
    assert container["image"] == "example/ss:1-vllm"
    assert not [name for name in env(pod) if name.startswith("SPLITSERVE_TP_")]   # vLLM spawns its own ranks
    args = container["args"]
    split = args.index("--")
    assert args[:3] == ["worker", "--engine", "vllm"] and "--tp" not in args[:split]
    assert args[split - 2:split] == ["--kv-cache-gib", "8"]                        # workerArgs: splitserve's
    assert args[split + 1:] == ["--quantization", "fp8", "--max-model-len=8192", "--tensor-parallel-size", "4"]
    # vLLM's start-up (profiling, compilation) gets 30 minutes before the pod counts as failed
    probe = container["startupProbe"]
    assert probe["grpc"]["port"] == names.WORKER_PORT and probe["periodSeconds"] * probe["failureThreshold"] == 1800
    assert container["readinessProbe"]["exec"]["command"] == builders.probe_command()
    # the frontends stay on the splitserve image
    frontend = builders.build_frontend_deployment(OWNER, VLLM)["spec"]["template"]["spec"]["containers"][0]
    assert frontend["image"] == VLLM.image


def test_vllm_pipeline_parallel_goes_to_vllm_too():
    spec = ServingDeploymentSpec.from_dict({**VLLM.to_dict(), "decode": {
        **VLLM.decode.to_dict(VLLM.engine), "tensorParallel": 2, "pipelineParallel": 2, "gpusPerRank": 2}})
    [pod] = builders.build_group_pods(OWNER, spec, "decode", "g0")
    container = pod["spec"]["containers"][0]
    assert container["args"][-4:] == ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]
    assert container["resources"]["requests"][names.GPU_RESOURCE] == "8"


def test_vllm_pod_args_parse_with_the_worker_cli():
    """What the operator passes is what `splitserve worker --engine vllm` accepts: its flags before
    `--`, vLLM's after (the worker's own parser, no process)."""
    from splitserve.services.cli.parsers import build_parser

    args = builders.build_worker_pod(OWNER, VLLM, "decode", "g0", 0)["spec"]["containers"][0]["args"]
    parsed = build_parser().parse_args(args)
    # A decode worker even with no prefill groups (it prefills its own prompts): scaling the
    # prefill pool up from 0 then rolls nothing.
    assert (parsed.command, parsed.engine, parsed.role, parsed.kv_connector) == ("worker", "vllm", "decode",
                                                                                "splitserve")
    assert (parsed.model, parsed.kv_cache_gib, parsed.port) == ("/models/qwen", 8.0, names.WORKER_PORT)
    assert parsed.engine_args == ["--quantization", "fp8", "--max-model-len=8192", "--tensor-parallel-size", "4"]


def test_vllm_prefill_and_decode_pools_take_their_roles_and_the_deployments_kv_connector():
    from splitserve.services.cli.parsers import build_parser

    pd = ServingDeploymentSpec.from_dict({**VLLM.to_dict(), "prefill": {"replicas": 1, "tensorParallel": 2,
                                                                        "gpusPerRank": 1}})
    for connector in ("splitserve", "nixl-vllm"):
        spec = ServingDeploymentSpec.from_dict({**pd.to_dict(), "kvConnector": connector})
        for pool in ("prefill", "decode"):
            args = builders.build_worker_pod(OWNER, spec, pool, "g0", 0)["spec"]["containers"][0]["args"]
            parsed = build_parser().parse_args(args)
            assert (parsed.engine, parsed.role, parsed.kv_connector) == ("vllm", pool, connector)
    # The connector is part of what a pod is built from: changing it rolls both pools. A
    # deployment that never set it keeps the hash it had before the field existed.
    nixl = ServingDeploymentSpec.from_dict({**pd.to_dict(), "kvConnector": "nixl-vllm"})
    for pool in ("prefill", "decode"):
        assert builders.pool_spec_hash(nixl, pool) != builders.pool_spec_hash(pd, pool)
    assert builders.pool_spec_hash(pd, "decode") == builders.pool_spec_hash(VLLM, "decode")


def test_the_engine_and_the_vllm_image_roll_the_pool_and_builtin_hashes_stay():
    # What the operator before `engine` computed for SPEC's pools: an upgraded operator rolls no
    # built-in pool, whatever vllmImage says.
    before = builders.pool_spec_hash(SPEC, "decode")
    assert (before, builders.pool_spec_hash(SPEC, "prefill")) == ("10f0b39012", "d4986a4c14")
    assert builders.pool_spec_hash(ServingDeploymentSpec.from_dict({**SPEC.to_dict(), "vllmImage": "x:9"}),
                                   "decode") == before
    vllm_decode = ServingDeploymentSpec.from_dict({**SPEC.to_dict(), "prefill": {"replicas": 0},
                                                   "decode": {**SPEC.decode.to_dict(), "engine": "vllm"}})
    assert builders.pool_spec_hash(vllm_decode, "decode") != before
    moved = ServingDeploymentSpec.from_dict({**VLLM.to_dict(), "vllmImage": "example/ss:2-vllm"})
    assert builders.pool_spec_hash(moved, "decode") != builders.pool_spec_hash(VLLM, "decode")
    assert builders.pool_spec_hash(ServingDeploymentSpec.from_dict({**VLLM.to_dict(), "image": "x:2"}),
                                   "decode") == builders.pool_spec_hash(VLLM, "decode")


def test_spec_tracing_reaches_every_frontend_and_worker_pod_and_rolls_only_then():
    from splitserve.services.cli.parsers import build_parser

    endpoint = "http://otel.obs:4317"
    traced = ServingDeploymentSpec.from_dict({**SPEC.to_dict(), "tracing": {"otlpTracesEndpoint": endpoint}})
    attributes = "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)"
    pods = [*builders.build_group_pods(OWNER, traced, "prefill", "llm-prefill-abc12"),
            *builders.build_group_pods(OWNER, traced, "decode", "llm-decode-abc12")]
    frontend = builders.build_frontend_deployment(OWNER, traced)["spec"]["template"]
    for pod in [*pods, frontend]:
        container = pod["spec"]["containers"][0]
        args, names_ = container["args"], [e["name"] for e in container["env"]]
        assert args[args.index("--otlp-traces-endpoint") + 1] == endpoint
        assert env(pod)["OTEL_RESOURCE_ATTRIBUTES"] == attributes
        # $(VAR) expands only against variables defined before it (Kubernetes' rule).
        assert names_.index("POD_NAME") < names_.index("OTEL_RESOURCE_ATTRIBUTES")
        assert names_.index("POD_NAMESPACE") < names_.index("OTEL_RESOURCE_ATTRIBUTES")
        parsed = build_parser().parse_args(args)
        assert parsed.otlp_traces_endpoint == endpoint
    # Off: no flag, no variable, and the pods of an untraced deployment keep their hash (no roll).
    for pod in [*builders.build_group_pods(OWNER, SPEC, "decode", "g"),
                builders.build_frontend_deployment(OWNER, SPEC)["spec"]["template"]]:
        assert "--otlp-traces-endpoint" not in pod["spec"]["containers"][0]["args"]
        assert "OTEL_RESOURCE_ATTRIBUTES" not in env(pod)
    assert builders.pool_spec_hash(SPEC, "decode") == "10f0b39012"
    assert builders.pool_spec_hash(traced, "decode") != builders.pool_spec_hash(SPEC, "decode")


def test_rank0_pods_carry_llm_ds_role_label_without_rolling():
    """llm-d's endpoint pickers filter by `llm-d.ai/role` (prefill | decode | prefill-decode) and
    take a labelled pod for an endpoint: rank 0 serves the worker API, ranks 1.. serve none. A
    decode worker never serves another worker's prefill, so it is `decode` also while the prefill
    pool is at 0. Labels are not what the spec hash is built from: pods built before keep their hash."""
    aggregated = ServingDeploymentSpec.from_dict({**SPEC.to_dict(), "prefill": {"replicas": 0},
                                                  "decode": {"tensorParallel": 2}})
    later_ranks = []
    for spec in (SPEC, aggregated):
        for pool in ("prefill", "decode"):
            rank0, *others = builders.build_group_pods(OWNER, spec, pool, f"llm-{pool}-abc12")
            assert rank0["metadata"]["labels"][names.LABEL_LLMD_ROLE] == pool
            later_ranks += others
    assert len(later_ranks) == 3 + 1          # SPEC's prefill ranks 1-3, aggregated's decode rank 1
    assert not [p for p in later_ranks if names.LABEL_LLMD_ROLE in p["metadata"]["labels"]]
    assert (builders.pool_spec_hash(SPEC, "decode"), builders.pool_spec_hash(SPEC, "prefill")) == ("10f0b39012",
                                                                                                 "d4986a4c14")


GATEWAY = ServingDeploymentSpec.from_dict({**SPEC.to_dict(), "decode": {"tensorParallel": 2},
                                           "disaggregationThreshold": 32, "gateway": {"enabled": True, "port": 8080}})


def test_gateway_mode_adds_a_frontend_for_its_own_worker_to_each_decode_rank0_pod():
    from splitserve.services.cli.parsers import build_parser

    rank0, rank1 = builders.build_group_pods(OWNER, GATEWAY, "decode", "llm-decode-abc12")
    assert [c["name"] for c in rank0["spec"]["containers"]] == ["worker", "frontend"]
    assert [c["name"] for c in rank1["spec"]["containers"]] == ["worker"]    # ranks 1.. serve no API
    for pod in builders.build_group_pods(OWNER, GATEWAY, "prefill", "llm-prefill-abc12"):
        assert [c["name"] for c in pod["spec"]["containers"]] == ["worker"]
    worker, frontend = rank0["spec"]["containers"]
    without = ServingDeploymentSpec.from_dict({**GATEWAY.to_dict(), "gateway": {"enabled": False}})
    assert worker == builders.build_worker_pod(OWNER, without, "decode", "llm-decode-abc12", 0)["spec"]["containers"][0]
    assert frontend["image"] == GATEWAY.image and frontend["command"] == ["splitserve"]
    parsed = build_parser().parse_args(frontend["args"])
    assert (parsed.command, parsed.gateway, parsed.worker) == ("frontend", True, [f"decode=127.0.0.1:{names.WORKER_PORT}"])
    assert (parsed.model, parsed.host, parsed.port) == ("smollm2", "0.0.0.0", 8080)
    assert parsed.remote_prefill_threshold == 32 and parsed.served_model_name is None
    assert not parsed.etcd and parsed.grpc_port is None          # it talks only to its own worker
    assert frontend["ports"] == [{"name": "http", "containerPort": 8080}]
    assert frontend["readinessProbe"] == {"httpGet": {"path": "/ready", "port": 8080}, "periodSeconds": 5}
    assert "env" not in frontend and "volumeMounts" not in frontend
    ports = [(p["name"], p["containerPort"]) for c in rank0["spec"]["containers"] for p in c["ports"]]
    assert len({n for n, _ in ports}) == len({p for _, p in ports}) == len(ports) == 5
    # The ordinary frontend Deployment stays as it was.
    assert builders.build_frontend_deployment(OWNER, GATEWAY) == builders.build_frontend_deployment(OWNER, without)


def test_gateway_mode_rolls_only_the_decode_pool_and_only_when_on():
    off = ServingDeploymentSpec.from_dict({**SPEC.to_dict(), "gateway": {"enabled": False, "port": 9000}})
    assert builders.pool_spec_hash(off, "decode") == builders.pool_spec_hash(SPEC, "decode") == "10f0b39012"
    on = ServingDeploymentSpec.from_dict({**SPEC.to_dict(), "gateway": {"enabled": True}})
    assert builders.pool_spec_hash(on, "decode") != builders.pool_spec_hash(SPEC, "decode")
    assert builders.pool_spec_hash(on, "prefill") == builders.pool_spec_hash(SPEC, "prefill")
    moved = ServingDeploymentSpec.from_dict({**on.to_dict(), "gateway": {"enabled": True, "port": 9000}})
    assert builders.pool_spec_hash(moved, "decode") != builders.pool_spec_hash(on, "decode")
    # A vLLM pool's workers run vllmImage, its gateway frontend `image`: changing `image` rolls it then.
    vllm_on = ServingDeploymentSpec.from_dict({**VLLM.to_dict(), "gateway": {"enabled": True}})
    vllm_moved = ServingDeploymentSpec.from_dict({**vllm_on.to_dict(), "image": "x:2"})
    assert builders.pool_spec_hash(vllm_moved, "decode") != builders.pool_spec_hash(vllm_on, "decode")
    [pod] = builders.build_group_pods(OWNER, vllm_on, "decode", "g0")
    worker, frontend = pod["spec"]["containers"]
    assert (worker["image"], frontend["image"]) == (VLLM.vllm_image, VLLM.image)
    assert frontend["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}}
    assert names.GPU_RESOURCE in worker["resources"]["requests"]


def test_gateway_frontend_is_traced_with_the_pods_identity():
    from splitserve.services.cli.parsers import build_parser

    traced = ServingDeploymentSpec.from_dict({**GATEWAY.to_dict(), "tracing": {"otlpTracesEndpoint": "http://o:4317"}})
    [_, frontend] = builders.build_worker_pod(OWNER, traced, "decode", "g0", 0)["spec"]["containers"]
    assert build_parser().parse_args(frontend["args"]).otlp_traces_endpoint == "http://o:4317"
    env_names = [e["name"] for e in frontend["env"]]
    assert env_names.index("POD_NAME") < env_names.index("OTEL_RESOURCE_ATTRIBUTES")


def test_a_named_weights_revision_reaches_every_worker_pod_and_none_is_named_by_default():
    """spec.model.revision: the workers' SPLITSERVE_WEIGHTS_REVISION (revision-safe pairing without
    every pod digesting the weight files at start)."""
    named = ServingDeploymentSpec.from_dict({"model": {"source": "smollm2", "revision": "release-7"}})
    for pool in ("prefill", "decode"):
        for pod in builders.build_group_pods(OWNER, named, pool, f"llm-{pool}-abc12"):
            assert env(pod)["SPLITSERVE_WEIGHTS_REVISION"] == "release-7"
    for pod in builders.build_group_pods(OWNER, SPEC, "prefill", "llm-prefill-abc12"):
        assert "SPLITSERVE_WEIGHTS_REVISION" not in env(pod)
