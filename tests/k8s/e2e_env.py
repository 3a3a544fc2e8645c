"""The end-to-end deployment of test_e2e_serving.py: the chart, the operator's pods, real workers.

`E2EDeployment.up()` builds, on the test control plane:
- a node of the test node agent (node_agent.py: pods run as real processes),
  untainted and labelled `E2E_LABEL=<token>`, which every worker group's topology
  requires (`same-label`), so no other node can take the deployment's pods;
- etcd with TLS and client certificates (splitserve.testing.etcd) on the host's
  127.0.0.1, reached by pods through the node's forward; its certificate names
  the node's address, the one the pods dial;
- `helm install` of the chart with that etcd as `etcd.external` and
  `etcd.tls.enabled` (client Secret `etcd-client`): the chart's operator
  Deployment runs on the agent's node as `splitserve operator`, in-cluster (its
  ServiceAccount's token, the chart's RBAC);
- a ServingDeployment of CPU worker groups (gpusPerRank 0) with the session's
  random llama: its pods are the operator's, unchanged; its `tracing` names a
  real OTLP receiver (splitserve.testing.otlp_collector) on the host's
  127.0.0.1, reached by pods through the node's forward like etcd.
The test reaches the frontend Service and the workers' gRPC from the host
through the agent's port forwards (the stand-in for `kubectl port-forward`).
"""

from __future__ import annotations

import base64
import json
import secrets
import ssl
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cluster import wait_until
from controlplane import KubeCluster
from node_agent import NodeAgent
from node_agent_workloads import next_pod_cidr
from operator_env import Api, condition, pool_status, sd_doc

from splitserve.operator import names
from splitserve.testing.certs import TestCA
from splitserve.testing.etcd import Etcd
from splitserve.testing.otlp_collector import OtlpCollector
from splitserve.testing.workers import worker_stats
from splitserve.tls import TlsConfig

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "splitserve"
E2E_LABEL = "splitserve.io/e2e"
SD_NAME = "llm"
RELEASE = "splitserve"
# Engine flags of every worker: a small KV pool, one torch thread (two cores for
# every process), and a short drain so that a deleted pod migrates its streams.
ENGINE_ARGS = ["--kv-cache-gib", "0.05", "--threads", "1", "--drain-timeout", "1"]


def pool(replicas: int, token: str, tp: int = 1, engine_args: list[str] | None = None) -> dict[str, Any]:
    return {"replicas": replicas, "tensorParallel": tp, "gpusPerRank": 0,
            "resources": {"cpu": "1", "memory": "2Gi"},
            "topology": {"mode": "same-label", "labelKey": E2E_LABEL},
            "engineArgs": list(engine_args or ENGINE_ARGS)}


@dataclass
class E2EDeployment:
    cluster: KubeCluster
    namespace: str
    agent: NodeAgent
    etcd: Etcd
    etcd_client: TlsConfig
    api: Api
    token: str
    model_dir: Path
    frontend: str = ""                   # 127.0.0.1:<port>, forwarded to the frontend Service
    collector: OtlpCollector | None = None   # the spec's tracing.otlpTracesEndpoint
    traces_endpoint: str = ""            # http://<node ip>:<port>, the collector as pods dial it
    _worker_forwards: dict[str, str] = field(default_factory=dict)   # pod IP -> 127.0.0.1:<port>

    # ---- bring-up ----------------------------------------------------------------

    @classmethod
    def up(cls, cluster: KubeCluster, namespace: str, model_dir: Path, workdir: Path,
           image_env: dict[str, dict[str, str]] | None = None,
           chart_values: dict[str, Any] | None = None) -> E2EDeployment:
        """`image_env`: the node agent's environment per image (NodeAgent.image_env);
        `chart_values`: more values for `helm install`, merged over the test's own (e.g. `gateway`)."""
        token = secrets.token_hex(3)
        agent = NodeAgent(cluster.api_client(), f"e2e-{token}", workdir / "agent", gpus=8, cpu="64",
                          memory="256Gi", pod_cidr=next_pod_cidr(), taint=None,
                          labels={E2E_LABEL: token}, image_env=dict(image_env or {})).start()
        etcd, env = None, None
        try:
            cluster.wait_node_ready(agent.node_name, True, timeout=30)
            assert agent.network is not None
            ca = TestCA(workdir / "etcd-pki")
            server, client = ca.issue("etcd", hosts=(agent.network.gateway, "127.0.0.1")), ca.issue("splitserve")
            etcd = Etcd(str(workdir / "etcd"), tls=TlsConfig(cert=str(server.cert), key=str(server.key),
                                                              ca=str(ca.ca_path)))
            etcd.start()
            env = cls(cluster, namespace, agent, etcd,
                      TlsConfig(cert=str(client.cert), key=str(client.key), ca=str(ca.ca_path)),
                      Api(cluster, namespace), token, model_dir)
            env.collector = OtlpCollector.start()
            env.traces_endpoint = f"http://{agent.expose_host_port(env.collector.port)}"
            env._install_chart(agent.expose_host_port(etcd.client_port), client, ca.ca_path, workdir, chart_values)
            return env
        except BaseException:
            agent.stop()
            cluster.delete_node(agent.node_name)
            if etcd is not None:
                etcd.stop()
            if env is not None and env.collector is not None:
                env.collector.stop()
            raise

    def _install_chart(self, etcd_address: str, client, ca_path: Path, workdir: Path,
                       extra_values: dict[str, Any] | None = None) -> None:
        core = self.cluster.core()
        core.create_namespaced_secret(self.namespace, {
            "metadata": {"name": "etcd-client"}, "type": "kubernetes.io/tls",
            "stringData": {"tls.crt": Path(client.cert).read_text(), "tls.key": Path(client.key).read_text(),
                           "ca.crt": ca_path.read_text()}})
        values = {"operator": {"extraArgs": ["--interval", "1"], "logLevel": "info"},
                  "etcd": {"external": {"endpoints": [f"https://{etcd_address}"]},
                           "tls": {"enabled": True, "clientSecretName": "etcd-client"}}}
        values = _merged(values, extra_values or {})
        (workdir / "values.yaml").write_text(yaml.safe_dump(values))
        self.cluster.helm("install", RELEASE, str(CHART), "-n", self.namespace, "-f", str(workdir / "values.yaml"),
                          timeout=180)
        pods = wait_until(lambda: [p for p in self.api.kubectl_json(
            "get", "pods", "-l", "splitserve.io/role=operator")["items"] if _ready(p)] or None,
            timeout=90, what="the chart's operator pod to be Ready")
        assert pods[0]["spec"]["nodeName"] == self.agent.node_name, pods[0]["spec"]

    def apply(self, decode_replicas: int = 2, decode_engine_args: list[str] | None = None) -> None:
        spec = {"model": {"source": str(self.model_dir), "dtype": "float32"},
                "router": {"policy": "round-robin"},
                "prefill": pool(1, self.token),
                "decode": pool(decode_replicas, self.token, tp=2, engine_args=decode_engine_args),
                "disaggregationThreshold": 0, "drainTimeoutSeconds": 60,
                "tracing": {"otlpTracesEndpoint": self.traces_endpoint}}
        self.api.apply(sd_doc(SD_NAME, spec))

    def wait_ready(self, decode: int, timeout: float = 180.0, prefill: int = 1) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            sd = self.api.sd(SD_NAME)
            status = sd.get("status") or {}
            ok = (condition(sd, "Ready").get("status") == "True"
                  and pool_status(sd, "decode").get("ready") == decode
                  and pool_status(sd, "prefill").get("ready", 0) == prefill
                  and (status.get("frontend") or {}).get("ready") == 1
                  and sd.get("status", {}).get("observedGeneration") == sd["metadata"]["generation"])
            return sd if ok else None

        try:
            return wait_until(ready, timeout=timeout, what=f"{SD_NAME} Ready with {prefill} prefill and {decode} decode "
                                                           f"groups", interval=0.5)
        except TimeoutError:
            raise AssertionError(self.diagnostics()) from None

    def open_frontend(self) -> str:
        if not self.frontend:
            self.frontend = self.agent.forward_service(self.namespace, names.frontend_name(SD_NAME), "http")
        return self.frontend

    # ---- what is running ---------------------------------------------------------

    def groups(self, pool_name: str) -> dict[str, list[dict[str, Any]]]:
        return self.api.groups(SD_NAME, pool_name)

    def rank0_pods(self, pool_name: str | None = None) -> list[dict[str, Any]]:
        pods = self.api.pods(SD_NAME, pool_name)
        return [p for p in pods if p["metadata"]["labels"][names.LABEL_RANK] == "0"
                and not p["metadata"].get("deletionTimestamp") and _ready(p)]

    def worker_address(self, pod: dict[str, Any]) -> str:
        ip = pod["status"]["podIP"]
        if ip not in self._worker_forwards:
            self._worker_forwards[ip] = self.agent.forward_pod(ip, names.WORKER_PORT)
        return self._worker_forwards[ip]

    def workers(self) -> dict[str, str]:
        """Every ready rank-0 worker: pod name -> a host address of its gRPC API."""
        return {p["metadata"]["name"]: self.worker_address(p) for p in self.rank0_pods()}

    def stats(self) -> dict[str, Any]:
        return {name: worker_stats(address) for name, address in self.workers().items()}

    def etcd_records(self) -> list[dict[str, Any]]:
        """Every worker registration in etcd, read from the host over TLS with the client certificate."""
        context = ssl.create_default_context(cafile=self.etcd_client.ca)
        context.load_cert_chain(self.etcd_client.cert, self.etcd_client.key)
        body = json.dumps({"key": base64.b64encode(b"\0").decode(), "range_end": base64.b64encode(b"\0").decode()})
        req = urllib.request.Request(f"https://127.0.0.1:{self.etcd.client_port}/v3/kv/range", body.encode(),
                                     method="POST")
        with urllib.request.urlopen(req, timeout=5, context=context) as resp:
            kvs = json.load(resp).get("kvs", [])
        out = []
        for kv in kvs:
            try:
                out.append(json.loads(base64.b64decode(kv["value"])))
            except ValueError:
                continue
        return out

    def diagnostics(self) -> str:
        lines = [json.dumps((self.api.sd(SD_NAME).get("status") or {}), indent=1)[:3000]]
        for pod in self.api.kubectl_json("get", "pods")["items"]:
            name = pod["metadata"]["name"]
            lines.append(f"--- {name} {pod['status'].get('phase')} on {pod['spec'].get('nodeName')}")
            try:
                lines.append(self.agent.container_log(self.namespace, name)[-1500:])
            except KeyError:
                pass
        return "\n".join(lines)

    # ---- teardown ----------------------------------------------------------------

    def down(self) -> None:
        try:
            self.cluster.kubectl("-n", self.namespace, "delete", "servingdeployment", SD_NAME, "--wait=true",
                                 "--timeout=90s", check=False, timeout=120)
            self.cluster.helm("uninstall", RELEASE, "-n", self.namespace, "--wait", "--timeout", "60s",
                              check=False, timeout=120)
        finally:
            self.agent.stop()
            self.cluster.delete_node(self.agent.node_name)
            self.etcd.stop()
            if self.collector is not None:
                self.collector.stop()


@contextmanager
def e2e_deployment(cluster: KubeCluster, prefix: str, model_dir: Path, workdir: Path,
                   image_env: dict[str, dict[str, str]] | None = None,
                   chart_values: dict[str, Any] | None = None) -> Iterator[E2EDeployment]:
    """`E2EDeployment.up()` in a namespace of its own (`prefix`-...), torn down and deleted after."""
    namespace = cluster.create_namespace(prefix)
    try:
        t0 = time.monotonic()
        env = E2EDeployment.up(cluster, namespace, model_dir, workdir, image_env, chart_values)
        print(f"\n[{prefix}] node, TLS etcd and chart (operator pod Ready) in {elapsed(t0)}")
        try:
            yield env
        finally:
            env.down()
    finally:
        cluster.delete_namespace(namespace)


def _merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` over `base`, maps merged key by key (as helm merges values files)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions", []))


def elapsed(t0: float) -> str:
    return f"{time.monotonic() - t0:.1f} s"
