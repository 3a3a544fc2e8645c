"""The operator on the real control plane: the chart installed with helm, the operator
as a local process, kwok GPU nodes, and a real worker process for the drain.

One module-scoped deployment (the chart's sample) walks through its life in
order: schema rejections, reconcile and all-or-nothing gang binding, Pending
with a reason until a node is added, group replacement after a pod deletion
and a NotReady node, scale-down draining through a real `splitserve worker`,
scaling a pool through its ServingPool, and garbage collection on delete.
Nodes that other tests left are cordoned for the module so that GPU counts here
are exactly the nodes this module adds.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml

from cluster import wait_until
from operator_env import Api, OperatorProcess, Worker, condition, group_phase, nodes_of, pool_status, sd_doc

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy/helm/splitserve"
SD = "sample"
WAIT_S = 45.0
SAMPLE_SPEC = {
    "model": {"source": "smollm2", "dtype": "bfloat16"},
    "frontend": {"replicas": 1},
    "prefill": {"replicas": 1, "tensorParallel": 2, "gpusPerRank": 1, "resources": {"cpu": "1", "memory": "1Gi"}},
    "decode": {"replicas": 1, "tensorParallel": 2, "gpusPerRank": 2, "resources": {"cpu": "1", "memory": "1Gi"}},
    # Room for the drain test's 600-token request on a loaded 2-core machine (CI's two pytest
    # workers ran it past 60 s once); nothing here waits for the timeout to pass.
    "drainTimeoutSeconds": 180,
}


class Env:
    def __init__(self, cluster, namespace: str, operator: OperatorProcess):
        self.cluster = cluster
        self.namespace = namespace
        self.operator = operator
        self.api = Api(cluster, namespace)
        self.nodes: list[str] = []

    def add_node(self, name: str, gpus: int, zone: str = "zone-a") -> str:
        self.cluster.add_gpu_node(name, gpus=gpus, zone=zone)
        self.nodes.append(name)
        return name

    def wait(self, predicate, what: str, timeout: float = WAIT_S):
        try:
            return wait_until(predicate, timeout=timeout, what=what, interval=0.2)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n--- status ---\n{json.dumps(self.api.sd(SD).get('status'), indent=1)}"
                                 f"\n--- operator log ---\n{self.operator.log()[-6000:]}") from None


@pytest.fixture(scope="module")
def env(kube_cluster, tmp_path_factory):
    namespace = kube_cluster.create_namespace("op")
    core = kube_cluster.core()
    cordoned = [n.metadata.name for n in core.list_node().items if not n.spec.unschedulable]
    for name in cordoned:
        kube_cluster.kubectl("cordon", name)
    values = tmp_path_factory.mktemp("helm") / "values.yaml"
    values.write_text(yaml.safe_dump({"etcd": {"persistence": {"enabled": False}},
                                      "operator": {"watchNamespaces": [namespace]},
                                      "sample": {"enabled": True, "name": SD, "spec": SAMPLE_SPEC}}))
    # The release is named after the namespace: its cluster-scoped RBAC objects then never
    # collide with another module's release.
    kube_cluster.helm("install", namespace, str(CHART), "--namespace", namespace, "--values", str(values))
    for crd in ("servingdeployments.splitserve.io", "servingpools.splitserve.io"):
        kube_cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=30s")
    operator = OperatorProcess.start(kube_cluster.kubeconfig, namespace,
                                     tmp_path_factory.mktemp("operator") / "operator.log")
    state = Env(kube_cluster, namespace, operator)
    try:
        yield state
    finally:
        code = operator.stop()
        kube_cluster.helm("uninstall", namespace, "--namespace", namespace, check=False)
        kube_cluster.delete_namespace(namespace)
        for name in state.nodes:
            kube_cluster.delete_node(name, wait=False)
        for name in cordoned:
            kube_cluster.kubectl("uncordon", name, check=False)
        assert code == 0, f"operator exited with {code}:\n{operator.log()[-4000:]}"


@pytest.mark.parametrize("patch, message", [
    ({"decode": {"replicas": -1}},
     "spec.decode.replicas: Invalid value: -1: spec.decode.replicas in body should be greater than or equal to 0"),
    ({"router": {"policy": "fastest"}}, 'spec.router.policy: Unsupported value: "fastest"'),
    ({"prefill": {"tensorParallel": 0}}, "spec.prefill.tensorParallel in body should be greater than or equal to 1"),
    ({"prefill": {"tensorParallel": 16, "pipelineParallel": 8}},
     "worker-group size (tensorParallel x pipelineParallel) must be between 1 and 64"),
    ({"decode": {"topology": {"mode": "same-label"}}}, "topology.labelKey is required with mode same-label"),
    ({"model": None}, "spec.model: Required value"),
    ({"engine": "sglang"}, 'spec.engine: Unsupported value: "sglang"'),
    ({"decode": {"engine": "vllm"}}, "the prefill and decode pools run different engines"),
    ({"kvConnector": "nixl-vllm"}, "kvConnector nixl-vllm is vLLM's own connector and needs engine vllm"),
])
def test_bad_specs_are_rejected_by_the_schema(env, patch, message):
    spec = {"model": {"source": "smollm2"}, **patch}
    if spec["model"] is None:
        del spec["model"]
    result = env.api.apply(sd_doc("bad", spec), check=False)
    assert result.returncode != 0, result.stdout
    assert message in " ".join(result.stderr.split()), result.stderr
    assert env.cluster.kubectl("-n", env.namespace, "get", "sd", "bad", check=False).returncode != 0


# Every call the operator makes, as (verb, resource, scope); scope "ns" is the watched
# namespace (the Lease lives there too: the release namespace), "all" is cluster-wide.
OPERATOR_CALLS = [
    *[(v, "pods", "ns") for v in ("get", "list", "watch", "create", "delete", "patch")],
    ("create", "pods/binding", "ns"),
    *[(v, r, "ns") for r in ("services", "configmaps", "deployments.apps") for v in ("get", "create", "patch")],
    ("create", "events", "ns"),
    *[(v, "servingdeployments.splitserve.io", "ns") for v in ("list", "watch", "patch")],
    ("patch", "servingdeployments.splitserve.io/status", "ns"),
    *[(v, "servingpools.splitserve.io", "ns") for v in ("get", "create", "patch")],
    ("patch", "servingpools.splitserve.io/status", "ns"),
    *[(v, "servingpools.splitserve.io/scale", "ns") for v in ("get", "patch")],    # spec.autoscaling
    *[(v, "leases.coordination.k8s.io", "ns") for v in ("get", "create", "update")],
    ("list", "nodes", "all"), ("watch", "nodes", "all"),
    ("list", "pods", "all"),      # free GPUs per node count the pods of every namespace
]


def test_chart_rbac_grants_every_call_the_operator_makes(env):
    accounts = env.api.kubectl_json("get", "serviceaccounts")["items"]
    [account] = [a["metadata"]["name"] for a in accounts if a["metadata"]["name"].endswith("operator")]
    user = f"system:serviceaccount:{env.namespace}:{account}"
    denied = []
    for verb, resource, scope in OPERATOR_CALLS:
        where = ["--all-namespaces"] if scope == "all" else ["-n", env.namespace]
        answer = env.cluster.kubectl("auth", "can-i", verb, resource, f"--as={user}", *where, check=False)
        if answer.stdout.strip() != "yes":
            denied.append(f"{verb} {resource} ({scope})")
    assert not denied, f"the chart's RBAC does not grant the operator: {', '.join(denied)}"


def test_sample_reconciles_and_gang_binds_all_or_nothing(env):
    api = env.api
    small = env.add_node("op-small", gpus=2)
    # Prefill (2 pods x 1 GPU, same node) fits; decode (2 x 2 GPUs on one node) cannot.
    env.wait(lambda: (pods := api.pods(SD, "prefill")) and len(pods) == 2 and all(nodes_of(pods)),
             "the prefill group to be bound")
    assert nodes_of(api.pods(SD, "prefill")) == [small, small]
    reason = env.wait(lambda: next((g["reason"] for g in pool_status(api.sd(SD), "decode").get("groups", [])
                                    if g["phase"] == "Pending" and "nvidia.com/gpu" in g.get("reason", "")), None),
                      "the decode group Pending with a reason")
    assert "no node has 4 free nvidia.com/gpu" in reason
    for _ in range(5):   # several operator passes: still nothing of the decode group bound
        decode = api.pods(SD, "decode")
        assert len(decode) == 2 and nodes_of(decode) == [None, None]
        time.sleep(0.3)
    assert any("waits" in m for m in api.event_messages(SD, "Unschedulable"))
    assert condition(api.sd(SD), "Degraded")["reason"] == "Unschedulable"

    uid = api.sd(SD)["metadata"]["uid"]
    for kind, name in [("deployment", "sample-frontend"), ("service", "sample-frontend"),
                       ("service", "sample-workers"), ("configmap", "sample-config"),
                       ("servingpool", "sample-prefill"), ("servingpool", "sample-decode")]:
        owners = api.kubectl_json("get", kind, name)["metadata"]["ownerReferences"]
        assert owners[0]["uid"] == uid and owners[0]["controller"] is True, (kind, name)
    pod = api.pods(SD, "prefill")[0]
    env_vars = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env_vars["SPLITSERVE_TP_WORLD_SIZE"] == "2" and pod["spec"]["schedulerName"] == "splitserve-gang"

    big = env.add_node("op-big", gpus=4)
    env.wait(lambda: nodes_of(api.pods(SD, "decode")) == [big, big], "the decode group to bind on the new node")
    sd = env.wait(lambda: (s := api.sd(SD)) and condition(s, "Ready").get("status") == "True" and s,
                  "the deployment to be Ready")
    assert pool_status(sd, "decode")["ready"] == 1 and pool_status(sd, "prefill")["ready"] == 1
    assert sd["status"]["observedGeneration"] == sd["metadata"]["generation"]
    lease = api.kubectl_json("get", "lease", "splitserve-operator")     # leader election is on
    assert lease["spec"]["holderIdentity"] and lease["spec"]["leaseDurationSeconds"] == 15
    printed = env.cluster.kubectl("-n", env.namespace, "get", "sd", SD).stdout
    assert "PREFILL-READY" in printed and "DECODE-DESIRED" in printed


def test_deleting_a_pod_replaces_its_group(env):
    api = env.api
    [old] = api.groups(SD, "decode")
    env.cluster.kubectl("-n", env.namespace, "delete", "pod", f"{old}-1", "--wait=false")
    new = env.wait(lambda: (g := api.groups(SD, "decode")) and old not in g and len(g) == 1
                   and all(nodes_of(next(iter(g.values())))) and next(iter(g)), "a replacement decode group")
    assert nodes_of(api.groups(SD, "decode")[new]) == ["op-big", "op-big"]
    assert any(old in m for m in api.event_messages(SD, "GroupFailed"))


def test_not_ready_node_replaces_its_group(env):
    api = env.api
    [old] = api.groups(SD, "prefill")
    env.cluster.set_node_ready("op-small", False)
    env.wait(lambda: old not in api.groups(SD, "prefill"), "the prefill group on the NotReady node to go")
    assert any(old in m and "op-small" in m for m in api.event_messages(SD, "GroupFailed"))
    # Its replacement has nowhere to go (op-big is full) until a node arrives.
    env.wait(lambda: any(g["phase"] == "Pending" for g in pool_status(api.sd(SD), "prefill").get("groups", [])),
             "the replacement prefill group Pending")
    assert all(n is None for n in nodes_of(api.pods(SD, "prefill")))
    spare = env.add_node("op-spare", gpus=2)
    env.wait(lambda: nodes_of(api.pods(SD, "prefill")) == [spare, spare], "the replacement to bind on the new node")


def _generate(address: str, max_tokens: int, out: dict) -> None:
    from splitserve.proto.v1 import common_pb2, worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        request = worker_pb2.TokenGenerateRequest(request_id="in-flight", token_ids=[1, 15043, 29892],
                                                  params=common_pb2.SamplingParams(max_tokens=max_tokens,
                                                                                   ignore_eos=True))
        num_tokens, finished = 0, False
        for reply in worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=120):
            num_tokens += len(reply.token_ids)
            finished = finished or reply.finished
    out.update(num_tokens=num_tokens, finished=finished, ended=time.monotonic())


def test_scale_down_drains_then_deletes_with_a_real_worker(env, llama_dir):
    from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc

    api = env.api
    env.add_node("op-big-2", gpus=4, zone="zone-b")
    env.cluster.kubectl("-n", env.namespace, "scale", "servingpool/sample-decode", "--replicas=2")
    env.wait(lambda: api.sd(SD)["spec"]["decode"]["replicas"] == 2, "the ServingPool scale copied into the spec")
    env.wait(lambda: pool_status(api.sd(SD), "decode").get("ready") == 2, "two ready decode groups")
    worker = Worker.start(llama_dir)
    try:
        for group in api.groups(SD, "decode"):
            env.cluster.kubectl("-n", env.namespace, "annotate", "pod", f"{group}-0",
                                f"splitserve.io/worker-address={worker.address}")
        result: dict = {}
        thread = threading.Thread(target=_generate, args=(worker.address, 600, result), daemon=True)
        thread.start()
        with grpc.insecure_channel(worker.address) as channel:
            stats = worker_pb2_grpc.WorkerStub(channel)
            env.wait(lambda: stats.Stats(worker_pb2.StatsRequest(), timeout=5).num_in_flight >= 1,
                     "the request to be in flight")
            env.cluster.kubectl("-n", env.namespace, "scale", f"sd/{SD}", "--replicas=1")
            message = env.wait(lambda: next(iter(api.event_messages(SD, "Draining")), None), "a Draining event")
            victim = message.split(" group ")[1].split()[0]
            phase = env.wait(lambda: group_phase(api.sd(SD), "decode", victim), "the victim's status")
            assert phase == "Draining" and "finished" not in result, (phase, result)
            assert len(api.groups(SD, "decode")[victim]) == 2          # not deleted while serving
            assert stats.Stats(worker_pb2.StatsRequest(), timeout=5).draining
            thread.join(240)
        assert result == {**result, "num_tokens": 600, "finished": True}, "the in-flight request was dropped"
        env.wait(lambda: victim not in api.groups(SD, "decode"), "the drained group to be deleted")
        reasons = [e["reason"] for e in api.events(SD) if victim in e["message"]]
        assert reasons.index("Draining") < reasons.index("Drained") < reasons.index("Deleted"), reasons
        [drained] = [m for m in api.event_messages(SD, "Drained") if victim in m]
        assert "no request in flight" in drained
        sd = env.wait(lambda: (s := api.sd(SD)) and pool_status(s, "decode").get("ready") == 1
                      and len(pool_status(s, "decode")["groups"]) == 1 and s, "one decode group left")
        assert env.api.kubectl_json("get", "servingpool", "sample-decode")["spec"]["replicas"] == 1
        assert sd["spec"]["decode"]["replicas"] == 1
    finally:
        worker.stop()


def test_scaling_a_pool_through_its_servingpool(env):
    api = env.api
    env.cluster.kubectl("-n", env.namespace, "scale", "servingpool/sample-prefill", "--replicas=0")
    env.wait(lambda: not api.pods(SD, "prefill"), "the prefill group to drain and go")
    sd = api.sd(SD)
    assert sd["spec"]["prefill"]["replicas"] == 0 and pool_status(sd, "prefill")["desired"] == 0
    assert any("worker unreachable" in m for m in api.event_messages(SD, "Drained"))


def test_image_change_rolls_groups_one_at_a_time(env):
    api = env.api
    [old] = api.groups(SD, "decode")
    env.cluster.kubectl("-n", env.namespace, "patch", "sd", SD, "--type=merge",
                        "-p", json.dumps({"spec": {"image": "example.invalid/splitserve:2"}}))
    lowest_ready = 1

    def rolled() -> bool:
        nonlocal lowest_ready
        phases = [g["phase"] for g in pool_status(api.sd(SD), "decode").get("groups", [])]
        lowest_ready = min(lowest_ready, phases.count("Ready"))
        groups = api.groups(SD, "decode")
        return (old not in groups and len(groups) == 1 and phases == ["Ready"]
                and all(p["spec"]["containers"][0]["image"] == "example.invalid/splitserve:2"
                        for p in next(iter(groups.values()))))

    env.wait(rolled, "the decode group replaced by one with the new image")
    assert lowest_ready >= 1, "the rolling update left the pool without a ready group"
    events = [e for e in api.events(SD) if old in e["message"]]
    reasons = [e["reason"] for e in events]
    # An event repeated by the operator is updated in place (count + 1, a new resourceVersion),
    # so the order of resourceVersions can put an early reason last; creation times cannot.
    created = {}
    for e in events:
        when = e["metadata"]["creationTimestamp"]
        created[e["reason"]] = min(when, created.get(e["reason"], when))
    assert {"Draining", "Drained", "Deleted"} <= set(created), reasons
    assert created["Draining"] <= created["Drained"] <= created["Deleted"], created
    assert any("RollingUpdate" in m and old in m for m in api.event_messages(SD, "Draining"))


def test_deleting_the_deployment_removes_everything_it_owns(env):
    api = env.api
    env.cluster.kubectl("-n", env.namespace, "delete", "sd", SD, "--wait=false")
    selector = f"splitserve.io/deployment={SD}"

    def leftovers() -> list[str]:
        found = api.kubectl_json("get", "pods,deployments,services,configmaps,servingpools", "-l", selector)
        return [f"{i['kind']}/{i['metadata']['name']}" for i in found["items"]]

    env.wait(lambda: not leftovers(), "garbage collection of everything the deployment owned", timeout=60)


def test_an_engine_vllm_deployment_runs_one_pod_per_group_with_vllms_flags(env):
    """engine: vllm (issue 38): a group is one pod asking for all tensorParallel GPUs (vLLM spawns
    its ranks itself), from the vLLM image, running `splitserve worker --engine vllm <operator's
    flags> -- <engineArgs> --tensor-parallel-size N`; the gang scheduler binds it whole."""
    api = env.api
    name = "vllm"
    # Room for it even beside the sample's groups (when this test runs without the ones before it).
    env.add_node("op-vllm", gpus=12)
    spec = {"model": {"source": "/models/qwen", "dtype": "float32"}, "engine": "vllm", "prefill": {"replicas": 0},
            "decode": {"replicas": 1, "tensorParallel": 4, "gpusPerRank": 1,
                       "resources": {"cpu": "1", "memory": "1Gi"}, "workerArgs": ["--kv-cache-gib", "2"],
                       "engineArgs": ["--max-model-len", "2048", "--enforce-eager"]}}
    api.apply(sd_doc(name, spec))
    [pod] = env.wait(lambda: (pods := api.pods(name, "decode")) and all(nodes_of(pods)) and pods,
                     "the vLLM group's one pod to be bound")
    container = pod["spec"]["containers"][0]
    args = container["args"]
    assert args[:3] == ["worker", "--engine", "vllm"] and "--tp" not in args
    assert args[args.index("--") - 2:] == ["--kv-cache-gib", "2", "--", "--max-model-len", "2048", "--enforce-eager",
                                           "--tensor-parallel-size", "4"]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "4"
    assert container["image"] == "ghcr.io/splitserve/splitserve:0.1.0-vllm"       # the CRD's vllmImage default
    assert not [e for e in container["env"] if e["name"].startswith("SPLITSERVE_TP_")]
    assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] == 1800
    sd = env.wait(lambda: (s := api.sd(name)) and condition(s, "Ready").get("status") == "True" and s,
                  "the vLLM deployment to be Ready")
    assert pool_status(sd, "decode")["ready"] == 1 and pool_status(sd, "prefill")["desired"] == 0
    frontend = api.kubectl_json("get", "deployment", f"{name}-frontend")["spec"]["template"]["spec"]
    assert frontend["containers"][0]["image"] == sd["spec"]["image"]               # frontends: the splitserve image
    printed = env.cluster.kubectl("-n", env.namespace, "get", "sd", name).stdout.split("\n")
    assert printed[0].split()[:3] == ["NAME", "MODEL", "ENGINE"] and printed[1].split()[:3] == [name, "/models/qwen",
                                                                                                "vllm"]
    # A prefill pool of another engine could never send this decode pool a prompt's KV: the
    # apiserver refuses the patch (a vLLM prefill pool is taken: test_chart.py).
    refused = env.cluster.kubectl("-n", env.namespace, "patch", "sd", name, "--type=merge", "-p",
                                  json.dumps({"spec": {"prefill": {"replicas": 1, "engine": "builtin"}}}), check=False)
    assert refused.returncode != 0 and "the prefill and decode pools run different engines" in refused.stderr
    env.cluster.kubectl("-n", env.namespace, "delete", "sd", name, "--wait=false")
    env.wait(lambda: not api.pods(name), "the vLLM deployment's pod to go", timeout=60)


def test_a_bind_failing_midway_rolls_the_whole_group_back(kube_cluster, k8s_namespace):
    """Rank 0 binds, rank 1's bind fails (the pod is gone): the scheduler deletes the
    group's pods rather than leave a half-bound group holding GPUs."""
    import asyncio

    from splitserve.operator.builders import Owner, build_group_pods
    from splitserve.operator.kube import AsyncKube, Kube, KubeError, core_path, load_api_client
    from splitserve.operator.placement import GroupRequest
    from splitserve.operator.scheduler import GangScheduler, WaitingGroup
    from splitserve.services.spec.serving_deployment import ServingDeploymentSpec

    node = "op-rollback"
    kube_cluster.add_gpu_node(node, gpus=8)
    try:
        kube = AsyncKube(Kube(load_api_client(kube_cluster.kubeconfig)))
        spec = ServingDeploymentSpec.from_dict({"model": {"source": "m"}, "decode": {"tensorParallel": 2}})
        [rank0, _] = build_group_pods(Owner("rb", k8s_namespace, "uid"), spec, "decode", "rb-decode-x")
        del rank0["metadata"]["ownerReferences"]          # no real owner: nothing to collect it

        async def scenario() -> str | None:
            await kube.create(core_path(k8s_namespace, "pods"), rank0)
            group = WaitingGroup(GroupRequest(f"{k8s_namespace}/rb-decode-x", "decode", 2, 1), k8s_namespace,
                                 ["rb-decode-x-0", "rb-decode-x-1"], "")   # rank 1 does not exist
            return await GangScheduler(kube)._bind_group(group, [node, node])

        error = asyncio.run(scenario())
        assert error is not None and "404" in error
        try:
            pod = asyncio.run(kube.request("GET", core_path(k8s_namespace, "pods", "rb-decode-x-0")))
            assert pod["metadata"].get("deletionTimestamp"), "rank 0 was left bound"
        except KubeError as exc:
            assert exc.not_found
    finally:
        kube_cluster.delete_node(node, wait=False)
