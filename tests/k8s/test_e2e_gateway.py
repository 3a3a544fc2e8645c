"""The endpoint picker end to end on the test control plane (issue 40): `helm install` with the
gateway switch on, a ServingDeployment in gateway mode, and `splitserve epp` in its pod picking
the pods the operator started.

One deployment for the module (e2e_env.py, with the chart's `gateway` values): the chart's
operator and EPP run in pods of the test node agent; the ServingDeployment (builtin engine, the
random Llama) has 1 prefill group and 1 decode group of tensorParallel 1 with `spec.gateway`, so
the decode pod also runs `splitserve frontend --gateway` on port 8000. The test plays the
gateway: it calls the EPP over ext_proc through a forward to the EPP Service's `grpc` port
(request headers, then the JSON body), reads the picked endpoint (`x-gateway-destination-endpoint`)
and prefill worker (`x-prefiller-host-port`), and sends the same request, with that header, to
the picked pod's port 8000, as Envoy would. A prompt past the disaggregation threshold is
prefilled by the prefill pod the EPP named, a short one by the decode pod itself; every answer
is token for token transformers' greedy output. Then the decode pod is deleted and the EPP
follows the operator's replacement.

The EPP pod's readiness probe is gRPC (port 9003, service `readiness`); the node agent runs gRPC
probes (node_agent_probes.py), so the pod's Ready condition is the probe's verdict, and the EPP
Service's endpoint (the forward) exists only once it passed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster import wait_until
from controlplane import KubeCluster
from e2e_env import SD_NAME, E2EDeployment, e2e_deployment, elapsed, pool
from e2e_load import served_model
from node_agent import AGENT_LABEL
from operator_env import sd_doc

from splitserve.operator import names
from splitserve.proto.v1 import ext_proc_pb2
from splitserve.services.epp.protocol import process_call
from splitserve.testing.models import random_prompt
from splitserve.testing.oracle import assert_greedy_match, hf_greedy
from splitserve.testing.workers import wait_idle

pytestmark = pytest.mark.slow

GIE_CRD = "inferencepools.inference.networking.k8s.io"
OBJECTIVE_CRD = "inferenceobjectives.inference.networking.x-k8s.io"     # installCRDs brings it too
GATEWAY_PORT = 8000                 # spec.gateway.port = the chart's gateway.targetPort (both defaults)
THRESHOLD = 32                      # disaggregationThreshold, and the EPP's --remote-prefill-threshold
LONG, SHORT = 48, 12                # prompt tokens: past the threshold (remote prefill), under it (local)
NEW_TOKENS = 8
DESTINATION, PREFILLER = "x-gateway-destination-endpoint", "x-prefiller-host-port"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


@pytest.fixture(scope="module")
def pod_model_dir(llama_dir: Path):
    """The random Llama where every pod sees it. There are no images: a container's root is the
    host's, and the chart's EPP pod mounts an emptyDir at /tmp, which hides pytest's temporary
    folder (llama_dir) from it. So the model goes outside /tmp (hard links where /var/tmp is on
    the same filesystem, else a copy of its 77 MB), and the workers use the same folder."""
    root = Path(tempfile.mkdtemp(prefix="splitserve-e2e-gateway-", dir="/var/tmp" if os.path.isdir("/var/tmp")
                                 else str(Path.home())))
    target = root / llama_dir.name

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
    try:
        shutil.copytree(llama_dir, target, copy_function=link_or_copy)
        yield target
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def e2e(kube_cluster: KubeCluster, pod_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    had = {crd for crd in (GIE_CRD, OBJECTIVE_CRD)
           if kube_cluster.kubectl("get", "crd", crd, check=False).returncode == 0}
    values = {"gateway": {"enabled": True, "deployment": SD_NAME, "installCRDs": True, "model": str(pod_model_dir),
                          "targetPort": GATEWAY_PORT,
                          "epp": {"logLevel": "debug", "extraArgs": ["--remote-prefill-threshold", str(THRESHOLD)],
                                  # the node agent's node (kwok nodes run nothing)
                                  "nodeSelector": {AGENT_LABEL: "true"}}}}
    try:
        with e2e_deployment(kube_cluster, "gw", pod_model_dir, tmp_path_factory.mktemp("e2e-gw"),
                            chart_values=values) as env:
            yield env
    finally:
        for crd in {GIE_CRD, OBJECTIVE_CRD} - had:   # helm never deletes a CRD it installed; nothing else uses them
            kube_cluster.kubectl("delete", "crd", crd, "--ignore-not-found", "--wait", "--timeout=60s", check=False)


@pytest.fixture(scope="module")
def cases(llama_dir: Path) -> dict[str, tuple[list[int], Any]]:
    """Prompts of seeds no other request uses (the EPP's router predicts what it routed in its index)."""
    prompts = {"long": random_prompt(601, LONG), "short": random_prompt(602, SHORT),
               "long-after": random_prompt(603, LONG)}
    refs = hf_greedy(llama_dir, list(prompts.values()), NEW_TOKENS, ignore_eos=True)
    return {key: (prompt, ref) for (key, prompt), ref in zip(prompts.items(), refs)}


# ---- the gateway's side: ext_proc to the EPP, then HTTP to the picked pod -------------------

@dataclass(frozen=True)
class Picked:
    status: int                     # 200: routed; else the EPP's immediate answer
    endpoint: str = ""              # x-gateway-destination-endpoint
    prefill: str = ""               # x-prefiller-host-port ("" when none)
    removed: tuple[str, ...] = ()   # headers the EPP removes from the request


class Gateway:
    def __init__(self, e2e: E2EDeployment, epp_service: str):
        self.e2e = e2e
        self.epp = e2e.agent.forward_service(e2e.namespace, epp_service, "grpc")
        self._pods: dict[str, str] = {}
        self.model = ""
        self.not_routed: list[str] = []     # what try_pick() saw instead of a pick

    def pick(self, body: dict[str, Any]) -> Picked:
        """One ext_proc stream as Envoy opens it: request headers, then the body with end_of_stream."""
        pairs = [(":method", "POST"), (":path", "/v1/completions"), (":authority", "gateway"),
                 ("content-type", "application/json")]
        messages = [
            ext_proc_pb2.ProcessingRequest(request_headers=ext_proc_pb2.HttpHeaders(headers=ext_proc_pb2.HeaderMap(
                headers=[ext_proc_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]))),
            ext_proc_pb2.ProcessingRequest(request_body=ext_proc_pb2.HttpBody(body=json.dumps(body).encode(),
                                                                              end_of_stream=True))]
        with grpc.insecure_channel(self.epp) as channel:
            responses = list(process_call(channel)(iter(messages), timeout=30))
        first = responses[0]
        if first.WhichOneof("response") == "immediate_response":
            return Picked(first.immediate_response.status.code)
        assert [r.WhichOneof("response") for r in responses] == ["request_headers", "request_body"], responses
        assert responses[1].request_body.response.body_mutation.streamed_response.body == json.dumps(body).encode()
        mutation = first.request_headers.response.header_mutation
        headers = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
        return Picked(200, headers[DESTINATION], headers.get(PREFILLER, ""), tuple(mutation.remove_headers))

    def try_pick(self, body: dict[str, Any]) -> Picked | None:
        """A pick, or None while the EPP cannot route yet (its answer 503, the forward not ready)."""
        try:
            picked = self.pick(body)
        except grpc.RpcError as exc:
            self.not_routed.append(f"{exc.code().name}: {exc.details()}")
            return None
        if picked.status != 200:
            self.not_routed.append(str(picked.status))
            return None
        return picked

    def pod(self, endpoint: str) -> str:
        """The host's forward to a picked `<pod IP>:<port>`."""
        if endpoint not in self._pods:
            ip, _, port = endpoint.rpartition(":")
            self._pods[endpoint] = self.e2e.agent.forward_pod(ip, int(port))
        return self._pods[endpoint]

    def send(self, picked: Picked, body: dict[str, Any]) -> list[int]:
        """The request to the picked pod, with the EPP's prefill header, as the gateway forwards it."""
        headers = {PREFILLER: picked.prefill} if picked.prefill else {}
        reply = httpx.post(f"http://{self.pod(picked.endpoint)}/v1/completions", json=body, headers=headers,
                           timeout=180)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["token_ids"]

    def body(self, prompt: list[int]) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def gateway(e2e: E2EDeployment) -> Gateway:
    pool_doc = e2e.api.kubectl_json("get", "inferencepool", SD_NAME)
    return Gateway(e2e, pool_doc["spec"]["endpointPickerRef"]["name"])


def _ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions", []))


def _epp_pod(e2e: E2EDeployment) -> dict[str, Any] | None:
    pods = [p for p in e2e.api.kubectl_json("get", "pods", "-l", "splitserve.io/role=epp")["items"]
            if not p["metadata"].get("deletionTimestamp")]
    return pods[0] if len(pods) == 1 else None


def _stats_delta(before: dict[str, Any], after: dict[str, Any], field: str) -> dict[str, int]:
    return {name: getattr(after[name], field) - getattr(before[name], field) for name in after}


# ---- the tests, in file order ---------------------------------------------------------------

def test_helm_install_creates_the_pool_and_a_ready_picker(e2e: E2EDeployment, gateway: Gateway):
    t0 = time.monotonic()
    pool_doc = e2e.api.kubectl_json("get", "inferencepool", SD_NAME)
    assert pool_doc["spec"]["selector"] == {"matchLabels": {names.LABEL_DEPLOYMENT: SD_NAME, names.LABEL_RANK: "0"}}
    assert pool_doc["spec"]["targetPorts"] == [{"number": GATEWAY_PORT}]
    ref = pool_doc["spec"]["endpointPickerRef"]
    assert (ref["kind"], ref["port"], ref["failureMode"]) == ("Service", {"number": 9002}, "FailClose")
    service = e2e.api.kubectl_json("get", "service", ref["name"])
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"grpc": 9002, "metrics": 9090}

    # Ready by its gRPC readiness probe (the node agent runs it): the EPP listed its pool in-cluster,
    # through the chart's Role, though the pool has no pods yet.
    pod = wait_until(lambda: (p := _epp_pod(e2e)) is not None and _ready(p) and p, timeout=120,
                     what="the EPP pod to be Ready", details=lambda: _epp_log(e2e))
    print(f"\n[gw] EPP pod Ready {elapsed(t0)} after the chart's operator")
    container = pod["spec"]["containers"][0]
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert container["args"][container["args"].index("--pool-name") + 1] == SD_NAME
    assert container["args"][-2:] == ["--remote-prefill-threshold", str(THRESHOLD)]
    assert pod["spec"]["nodeName"] == e2e.agent.node_name and pod["status"]["containerStatuses"][0]["ready"]
    assert "epp: ext_proc listening on 0.0.0.0:9002" in _epp_log(e2e)

    # The gateway's view through the Service: grpc.health.v1 on the ext_proc port (Envoy's check).
    with grpc.insecure_channel(gateway.epp) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service_name in ("", EXT_PROC_SERVICE):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service_name), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service_name
    # No model server yet: the protocol's 503.
    assert gateway.pick({"model": "any", "prompt": [5, 6, 7], "max_tokens": 1}).status == 503


def test_the_picker_picks_the_operators_pods_and_they_serve_token_exact(e2e: E2EDeployment, gateway: Gateway,
                                                                        cases, pod_model_dir: Path):
    t0 = time.monotonic()
    spec = {"model": {"source": str(pod_model_dir), "dtype": "float32"},
            "prefill": pool(1, e2e.token), "decode": pool(1, e2e.token),
            "disaggregationThreshold": THRESHOLD, "gateway": {"enabled": True, "port": GATEWAY_PORT}}
    e2e.api.apply(sd_doc(SD_NAME, spec))
    e2e.wait_ready(decode=1, prefill=1, timeout=300)
    print(f"[gw] ServingDeployment Ready (1 prefill, 1 decode group in gateway mode) in {elapsed(t0)}")
    [decode] = e2e.rank0_pods("decode")
    [prefill] = e2e.rank0_pods("prefill")
    assert decode["metadata"]["labels"][names.LABEL_LLMD_ROLE] == "decode"
    assert prefill["metadata"]["labels"][names.LABEL_LLMD_ROLE] == "prefill"
    assert [c["name"] for c in decode["spec"]["containers"]] == ["worker", names.GATEWAY_CONTAINER]
    decode_endpoint = f"{decode['status']['podIP']}:{GATEWAY_PORT}"
    prefill_worker = f"{prefill['status']['podIP']}:{names.WORKER_PORT}"
    gateway.model = served_model(gateway.pod(decode_endpoint))

    # The EPP learns both pods from the pool once they are Ready, and then their workers' health
    # and Describe: routed with a prefill pick within seconds (a fresh prompt each try: a routed
    # one is predicted cached). Pods taken while Running, before their workers listened, took
    # 30-40 s more here (gRPC reconnect backoff; pool_pods.py).
    tries, answers = iter(range(500, 600)), []
    t1 = time.monotonic()

    def routes_with_a_prefill_pick() -> Picked | None:
        picked = gateway.try_pick(gateway.body(random_prompt(next(tries), LONG)))
        answers.append(picked)
        return picked if picked is not None and picked.prefill else None
    warm = wait_until(routes_with_a_prefill_pick, timeout=30, interval=0.5,
                      what="the EPP to route to the Ready pods with a prefill pick",
                      details=lambda: (answers[-3:], gateway.not_routed[-3:], _epp_log(e2e)))
    assert (warm.endpoint, warm.prefill) == (decode_endpoint, prefill_worker), warm
    print(f"[gw] the EPP routes to both pods {elapsed(t1)} after Ready ({len(answers)} tries; not routed: "
          f"{gateway.not_routed})")

    names_ = {"decode": decode["metadata"]["name"], "prefill": prefill["metadata"]["name"]}
    prompt, ref = cases["long"]
    before = e2e.stats()
    picked = gateway.pick(gateway.body(prompt))
    assert picked == Picked(200, decode_endpoint, prefill_worker), picked
    tokens = gateway.send(picked, gateway.body(prompt))
    assert_greedy_match(tokens, ref)
    assert len(tokens) == NEW_TOKENS
    after = e2e.stats()
    assert _stats_delta(before, after, "num_prefills_served")[names_["prefill"]] == 1
    assert _stats_delta(before, after, "num_remote_prefills")[names_["decode"]] == 1
    assert after[names_["decode"]].num_prefill_fallbacks == before[names_["decode"]].num_prefill_fallbacks

    # Under the threshold: no prefill pick (and a client's own header is removed); the decode pod
    # prefills it. (Its local prefills may also count the operator's readiness canaries.)
    prompt, ref = cases["short"]
    before = after
    picked = gateway.pick(gateway.body(prompt))
    assert (picked.endpoint, picked.prefill) == (decode_endpoint, ""), picked
    assert PREFILLER in picked.removed
    tokens = gateway.send(picked, gateway.body(prompt))
    assert_greedy_match(tokens, ref)
    assert len(tokens) == NEW_TOKENS
    after = e2e.stats()
    assert _stats_delta(before, after, "num_local_prefills")[names_["decode"]] >= 1
    assert _stats_delta(before, after, "num_remote_prefills")[names_["decode"]] == 0
    assert _stats_delta(before, after, "num_prefills_served")[names_["prefill"]] == 0


def test_the_picker_follows_a_replaced_decode_pod(e2e: E2EDeployment, gateway: Gateway, cases):
    [old] = e2e.rank0_pods("decode")
    [prefill] = e2e.rank0_pods("prefill")
    old_name, old_endpoint = old["metadata"]["name"], f"{old['status']['podIP']}:{GATEWAY_PORT}"
    t0 = time.monotonic()
    e2e.cluster.kubectl("-n", e2e.namespace, "delete", "pod", old_name, "--wait=false")

    def new_leader() -> dict[str, Any] | None:
        return next((p for p in e2e.api.pods(SD_NAME, "decode") if p["metadata"]["labels"][names.LABEL_RANK] == "0"
                     and p["metadata"]["name"] != old_name and (p.get("status") or {}).get("podIP")), None)
    new = wait_until(new_leader, timeout=120, what="the operator's replacement decode pod to have an IP")
    new_name, new_endpoint = new["metadata"]["name"], f"{new['status']['podIP']}:{GATEWAY_PORT}"
    assert new_endpoint != old_endpoint
    seen: list[str] = []
    tries = iter(range(700, 1000))
    gateway.not_routed.clear()

    def picks_the_new_pod() -> Picked | None:
        picked = gateway.try_pick(gateway.body(random_prompt(next(tries), SHORT)))
        if picked is not None:
            seen.append(picked.endpoint)
        return picked if picked is not None and picked.endpoint == new_endpoint else None
    wait_until(picks_the_new_pod, timeout=240, interval=1.0, what=f"the EPP to pick the new pod {new_endpoint}",
               details=lambda: (seen[-5:], gateway.not_routed[-5:], _epp_log(e2e)))
    print(f"[gw] the EPP picks the new decode pod {new_name} {elapsed(t0)} after the delete "
          f"({len(gateway.not_routed)} tries not routed, {len(seen) - 1} routed elsewhere)")
    assert old_endpoint not in seen, seen
    assert _ready(e2e.api.kubectl_json("get", "pod", new_name))       # the EPP takes Ready pods only

    # The replacement serves what the EPP sends it, with the same prefill pod.
    e2e.wait_ready(decode=1, prefill=1, timeout=240)
    assert [p["metadata"]["name"] for p in e2e.rank0_pods("decode")] == [new_name]
    prompt, ref = cases["long-after"]
    before = e2e.stats()
    picked = gateway.pick(gateway.body(prompt))
    assert picked == Picked(200, new_endpoint, f"{prefill['status']['podIP']}:{names.WORKER_PORT}"), picked
    tokens = gateway.send(picked, gateway.body(prompt))
    assert_greedy_match(tokens, ref)
    assert len(tokens) == NEW_TOKENS
    after = e2e.stats()
    assert _stats_delta(before, after, "num_remote_prefills")[new_name] == 1
    assert _stats_delta(before, after, "num_prefills_served")[prefill["metadata"]["name"]] == 1
    workers = e2e.workers()
    wait_idle(workers, 15.0)
    print(f"[gw] no KV block held on {len(workers)} workers: {sorted(workers)}")


def _epp_log(e2e: E2EDeployment) -> str:
    pod = _epp_pod(e2e)
    if pod is None:
        return "(no EPP pod)"
    try:
        return e2e.agent.container_log(e2e.namespace, pod["metadata"]["name"])[-8000:]
    except KeyError:
        return f"(EPP pod {pod['metadata']['name']} not on the agent's node: {pod['spec'].get('nodeName')})"

