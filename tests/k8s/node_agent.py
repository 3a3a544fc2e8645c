"""The test node agent: a stand-in for kubelet + container runtime on one Node.

TEST INFRASTRUCTURE, not part of splitserve. kwok simulates nodes whose pods
never run; pods bound to a node of this agent run for real, as host processes:

- The agent registers (or adopts) a Node with a pod CIDR, cpu/memory/pods and
  `nvidia.com/gpu` capacity (so the operator's gang scheduler can bind to it),
  the Ready condition and an InternalIP (the node bridge's address); it renews
  the node's Lease in kube-node-lease every second and re-posts the node's
  conditions every few seconds, as kubelet does. The node is labelled
  `splitserve.io/node-agent` and tainted (NoSchedule) with `AGENT_TAINT` by
  default, so the default scheduler puts there only pods that tolerate it
  (`TOLERATION`); operator tests use `GPU_TAINT`, which the operator's pods
  tolerate. It has no kwok annotation, so kwok leaves it alone.
- It watches the pods bound to it (fieldSelector spec.nodeName=<node>) and
  gives each a `PodSupervisor` (node_agent_pod.py): a network namespace with an
  IP from the pod CIDR on the node's bridge (node_agent_net.py), the
  container's command/args/env as Kubernetes resolves them (node_agent_spec.py),
  probes (node_agent_probes.py), restarts, status, graceful deletion.
- There is no image: a container runs the host's programs (the venv's python
  and `splitserve` first on PATH), which stand in for the image; a container
  without `command` runs `splitserve`, our image's entrypoint. `image_env` gives
  the containers of one image more environment over that (the image's vLLM flavour:
  the vLLM engine environment's bin first on PATH).
- Host servers: `expose_host_port()` relays a port on the node's address to
  the host's 127.0.0.1 (node_agent_forward.py), e.g. the control plane's etcd.
  The `kubernetes` Service: its ClusterIP is an address of the node namespace,
  relayed to the apiserver, and containers get KUBERNETES_SERVICE_HOST/PORT and
  (volumes, node_agent_volumes.py) their ServiceAccount's token, as kubelet
  gives them: in-cluster clients (the chart's operator pod) work unchanged.
- From the host: `forward_service()` / `forward_pod()` listen on the host's
  127.0.0.1 and relay each connection into the node network (a ready endpoint
  of the Service, or one pod), the stand-in for `kubectl port-forward`.
- Names: no cluster DNS; each pod's /etc/hosts (through `ip netns exec`'s
  /etc/netns bind mount) carries its own name and what DNS would answer for
  the headless Services selecting this node's pods (node_agent_hosts.py),
  refreshed every second.

`stop()` kills every pod process and removes every namespace the agent made;
`start()` first sweeps the namespaces of agents that were killed.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import itertools
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from node_agent_forward import HostPortForward, IntoClusterForward
from node_agent_hosts import HostedPod, hosts_text, service_records, write_in_place
from node_agent_net import ETC_NETNS, NAME_PREFIX, ClusterNetwork, NodeNetwork, ip, sweep_stale_namespaces
from node_agent_pod import PodSupervisor, now_iso
from node_agent_spec import decode_secret

AGENT_LABEL = "splitserve.io/node-agent"
AGENT_TAINT = {"key": AGENT_LABEL, "value": "true", "effect": "NoSchedule"}
TOLERATION = {"key": AGENT_LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"}
# The taint real GPU nodes carry. The operator's gang scheduler takes nodes tainted
# only with it (its pods tolerate nvidia.com/gpu), and refuses AGENT_TAINT.
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
LEASE_NAMESPACE = "kube-node-lease"
LEASE_SECONDS = 40            # kubelet's default; renewed every LEASE_RENEW
LEASE_RENEW = 1.0
STATUS_EVERY = 5.0
_agent_counter = itertools.count(1)


def _micro_time() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def default_base_env() -> dict[str, str]:
    """The environment every container starts from: the host's PATH, the venv's bin first."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "/usr/bin:/bin")])
    keep = {k: os.environ[k] for k in ("HOME", "LANG", "LC_ALL", "VIRTUAL_ENV", "TMPDIR") if k in os.environ}
    return {"PATH": path, **keep}


def new_cluster_network() -> ClusterNetwork:
    """A network linking the agents given it (`NodeAgent(cluster=...)`); destroy() it after them."""
    sweep_stale_namespaces()
    return ClusterNetwork(f"{NAME_PREFIX}-{os.getpid()}-c{next(_agent_counter)}").create()


def _node_conditions(now: str, since: str) -> list[dict[str, str]]:
    base = [("MemoryPressure", "False", "KubeletHasSufficientMemory"),
            ("DiskPressure", "False", "KubeletHasNoDiskPressure"),
            ("PIDPressure", "False", "KubeletHasSufficientPID"),
            ("Ready", "True", "KubeletReady")]
    return [{"type": t, "status": s, "reason": r, "message": "splitserve test node agent",
             "lastHeartbeatTime": now, "lastTransitionTime": since} for t, s, r in base]


@dataclass
class NodeAgent:
    """One node run by the agent (see the module docstring)."""

    api: client.ApiClient
    node_name: str
    workdir: Path
    gpus: int = 8
    cpu: str = "16"
    memory: str = "64Gi"
    pod_cidr: str = "10.245.1.0/24"
    labels: dict[str, str] = field(default_factory=dict)
    taint: dict[str, str] | None = field(default_factory=lambda: dict(AGENT_TAINT))
    entrypoints: dict[str, tuple[str, ...]] = field(default_factory=dict)
    base_env: dict[str, str] = field(default_factory=default_base_env)
    image_env: dict[str, dict[str, str]] = field(default_factory=dict)   # image -> env over base_env
    cluster: ClusterNetwork | None = None      # links this node's pods to other agents' nodes
    network: NodeNetwork | None = None
    pods: dict[str, PodSupervisor] = field(default_factory=dict)   # by uid
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    errors: list[str] = field(default_factory=list)   # crashes of pod supervisors (agent bugs)
    forwards: list[HostPortForward | IntoClusterForward] = field(default_factory=list)
    service_env: dict[str, str] = field(default_factory=dict)
    _node_uid: str = ""
    _ready_since: str = ""

    @property
    def node_netns(self) -> str:
        assert self.network is not None
        return self.network.netns

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    # ---- lifecycle -------------------------------------------------------------

    def start(self) -> NodeAgent:
        sweep_stale_namespaces()
        prefix = f"{NAME_PREFIX}-{os.getpid()}-{next(_agent_counter)}"
        self.network = NodeNetwork(prefix, ipaddress.ip_network(self.pod_cidr))
        self.network.create()
        if self.cluster is not None:
            self.cluster.attach(self.network)
            self.cluster.agents.append(self)
        self._serve_kubernetes_service()
        self._register_node()
        self._ready_since = now_iso()
        self._post_node_status()
        self._renew_lease()
        for target, name in ((self._heartbeat, "heartbeat"), (self._watch_pods, "pod-watch")):
            t = threading.Thread(target=target, name=f"node-agent-{name}-{self.node_name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Kill every pod's processes (grace 0), stop the loops, remove the namespaces."""
        self._stop.set()
        with self._lock:
            supervisors = list(self.pods.values())
        for sup in supervisors:
            sup.request_deletion(0, gone=True)
        for sup in supervisors:
            sup.join(timeout)
        for t in self._threads:
            t.join(timeout)
        for forward in self.forwards:
            forward.stop()
        if self.network is not None:
            if self.cluster is not None:
                self.cluster.detach(self.network)
                self.cluster.agents.remove(self)
            self.network.destroy()

    def expose_host_port(self, host_port: int) -> str:
        """Make the host's 127.0.0.1:`host_port` reachable from pods; returns `<node ip>:<port>`
        (node_agent_forward.py) — how pods reach the control plane's etcd, for one."""
        assert self.network is not None
        forward = HostPortForward(self.network.netns, self.network.gateway, host_port).start()
        self.forwards.append(forward)
        return forward.address

    def _serve_kubernetes_service(self) -> None:
        """The `kubernetes` Service's ClusterIP:port in the node namespace, relayed to the apiserver
        (what kube-proxy's rules do on a node), and the env kubelet gives every container for it."""
        assert self.network is not None
        svc = self.core.read_namespaced_service("kubernetes", "default")
        cluster_ip, port = svc.spec.cluster_ip, svc.spec.ports[0].port
        host_port = int(self.api.configuration.host.rsplit(":", 1)[1])
        ip("addr", "add", f"{cluster_ip}/32", "dev", "lo", netns=self.network.netns)
        self.forwards.append(HostPortForward(self.network.netns, cluster_ip, host_port, listen_port=port).start())
        self.service_env = {"KUBERNETES_SERVICE_HOST": cluster_ip, "KUBERNETES_SERVICE_PORT": str(port),
                            "KUBERNETES_SERVICE_PORT_HTTPS": str(port),
                            "KUBERNETES_PORT": f"tcp://{cluster_ip}:{port}"}

    def forward_pod(self, pod_ip: str, port: int) -> str:
        """`127.0.0.1:<port>` on the host relayed to `pod_ip:port` (kubectl port-forward pod/...)."""
        assert self.network is not None
        forward = IntoClusterForward(self.network.netns, lambda: (pod_ip, port)).start()
        self.forwards.append(forward)
        return forward.address

    def forward_service(self, namespace: str, name: str, port_name: str) -> str:
        """`127.0.0.1:<port>` on the host; each connection goes to a ready endpoint of the Service
        (round robin over its EndpointSlices, read per connection, as kube-proxy follows them)."""
        assert self.network is not None
        turn = itertools.count()

        def pick() -> tuple[str, int] | None:
            slices = client.DiscoveryV1Api(self.api).list_namespaced_endpoint_slice(
                namespace, label_selector=f"kubernetes.io/service-name={name}").items
            targets = [(address, p.port) for sl in slices for p in (sl.ports or []) if p.name == port_name
                       for ep in (sl.endpoints or []) if (ep.conditions is None or ep.conditions.ready)
                       for address in ep.addresses]
            return sorted(targets)[next(turn) % len(targets)] if targets else None

        forward = IntoClusterForward(self.network.netns, pick).start()
        self.forwards.append(forward)
        return forward.address

    def _token(self, account: str, audience: str | None, seconds: int, pod: dict[str, Any]) -> str:
        """A token bound to the pod (TokenRequest), as kubelet projects it."""
        meta = pod["metadata"]
        spec: dict[str, Any] = {"expirationSeconds": max(seconds, 600), "boundObjectRef": {
            "apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}}
        if audience:
            spec["audiences"] = [audience]
        answer = self.core.create_namespaced_service_account_token(account, meta["namespace"], {"spec": spec})
        return answer.status.token

    def pod_netns(self, namespace: str, name: str) -> str:
        """The network namespace of a running pod (for in-namespace clients in tests)."""
        return self._supervisor(namespace, name).netns

    def container_log(self, namespace: str, name: str, container: str | None = None) -> str:
        """What the container wrote to stdout/stderr, all its restarts together."""
        sup = self._supervisor(namespace, name)
        run = sup.containers[0] if container is None else next(c for c in sup.containers if c.name == container)
        return run.log_path.read_text(errors="replace") if run.log_path.exists() else ""

    def finished_log(self, namespace: str, name: str) -> str:
        """What the (first) container of a pod that may be gone already wrote (its work folder stays)."""
        logs = sorted((self.workdir / "pods").glob(f"{namespace}_{name}_*/*.log"))
        return "".join(p.read_text(errors="replace") for p in logs)

    def _supervisor(self, namespace: str, name: str) -> PodSupervisor:
        with self._lock:
            for sup in self.pods.values():
                if sup.key == f"{namespace}/{name}":
                    return sup
        raise KeyError(f"pod {namespace}/{name} is not on node {self.node_name}")

    # ---- the Node and its heartbeats --------------------------------------------

    def _node_body(self) -> dict[str, Any]:
        resources = {"cpu": self.cpu, "memory": self.memory, "pods": "110", "nvidia.com/gpu": str(self.gpus),
                     "ephemeral-storage": "100Gi"}
        labels = {"kubernetes.io/hostname": self.node_name, "kubernetes.io/os": "linux",
                  "kubernetes.io/arch": "amd64", AGENT_LABEL: "true", **self.labels}
        spec: dict[str, Any] = {"podCIDR": self.pod_cidr, "podCIDRs": [self.pod_cidr]}
        if self.taint:
            spec["taints"] = [self.taint]
        return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node_name, "labels": labels},
                "spec": spec, "status": {"capacity": resources, "allocatable": dict(resources)}}

    def _register_node(self) -> None:
        body = self._node_body()
        try:
            node = self.core.create_node(body)
        except ApiException as e:
            if e.status != 409:
                raise
            # Adopt: labels and taints are ours; the pod CIDR is immutable once set, so it must match.
            node = self.core.patch_node(self.node_name, {"metadata": {"labels": body["metadata"]["labels"]},
                                                         "spec": {"taints": body["spec"].get("taints", [])}})
            if node.spec.pod_cidr not in (None, self.pod_cidr):
                raise RuntimeError(f"node {self.node_name} has podCIDR {node.spec.pod_cidr}, not {self.pod_cidr}")
        self._node_uid = node.metadata.uid

    def _post_node_status(self) -> None:
        assert self.network is not None
        body = self._node_body()["status"]
        body.update({"conditions": _node_conditions(now_iso(), self._ready_since),
                     "addresses": [{"type": "InternalIP", "address": self.network.gateway},
                                   {"type": "Hostname", "address": self.node_name}],
                     "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux", "bootID": "",
                                  "machineID": "", "systemUUID": "", "osImage": "splitserve test node agent",
                                  "kernelVersion": os.uname().release, "kubeletVersion": "splitserve-node-agent",
                                  "kubeProxyVersion": "", "containerRuntimeVersion": "splitserve-node-agent://0"}})
        self.core.patch_node_status(self.node_name, {"status": body})

    def _renew_lease(self) -> None:
        coord = client.CoordinationV1Api(self.api)
        spec = {"holderIdentity": self.node_name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": _micro_time()}
        try:
            coord.patch_namespaced_lease(self.node_name, LEASE_NAMESPACE, {"spec": spec})
        except ApiException as e:
            if e.status != 404:
                raise
            owner = {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": self._node_uid}
            coord.create_namespaced_lease(LEASE_NAMESPACE, {
                "metadata": {"name": self.node_name, "namespace": LEASE_NAMESPACE, "ownerReferences": [owner]},
                "spec": spec})

    def _heartbeat(self) -> None:
        last_status = time.monotonic()
        while not self._stop.wait(LEASE_RENEW):
            try:
                self._renew_lease()
                self._refresh_hosts()
                if time.monotonic() - last_status >= STATUS_EVERY:
                    self._post_node_status()
                    last_status = time.monotonic()
            except ApiException as e:
                if e.status == 404:      # the node was deleted (a test removing it): stop heartbeating
                    return
            except Exception:            # the apiserver going away at teardown
                if self._stop.is_set():
                    return

    def _refresh_hosts(self) -> None:
        """Rewrite each pod's /etc/hosts with the names cluster DNS would give (node_agent_hosts.py)."""
        hosted: list[HostedPod] = []
        with self._lock:
            own = {s.netns for s in self.pods.values()}
        for agent in list(self.cluster.agents) if self.cluster is not None else [self]:
            with agent._lock:
                sups = [s for s in agent.pods.values() if s.deletion_grace is None]
            hosted += [HostedPod.of(s.pod, s.pod_ip, s.ready, ETC_NETNS / s.netns / "hosts") for s in sups]
        services = [self.api.sanitize_for_serialization(svc)
                    for ns in sorted({h.namespace for h in hosted})
                    for svc in self.core.list_namespaced_service(ns).items]
        records = service_records(hosted, services)
        for h in hosted:
            if h.hosts_path.parent.name not in own:
                continue                 # another agent's pod: that agent writes its file
            try:
                write_in_place(h.hosts_path, hosts_text(h, records))
            except OSError:
                pass                     # the pod's namespace is being removed

    # ---- pods ----------------------------------------------------------------------

    def _watch_pods(self) -> None:
        while not self._stop.is_set():
            w = watch.Watch()
            try:
                for event in w.stream(self.core.list_pod_for_all_namespaces,
                                      field_selector=f"spec.nodeName={self.node_name}", timeout_seconds=2):
                    if self._stop.is_set():
                        break
                    self._on_pod_event(event["type"], event["raw_object"])
            except Exception:            # a dropped watch (410, connection reset): list + watch again
                if self._stop.wait(0.5):
                    break
            finally:
                w.stop()

    def _on_pod_event(self, kind: str, pod: dict[str, Any]) -> None:
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return
        uid, meta = pod["metadata"]["uid"], pod["metadata"]
        with self._lock:
            sup = self.pods.get(uid)
        if kind == "DELETED":
            if sup is not None:
                sup.request_deletion(0, gone=True)
            return
        if meta.get("deletionTimestamp"):
            if sup is not None:
                sup.request_deletion(meta.get("deletionGracePeriodSeconds"))
            else:
                self._finish_deletion(pod)
            return
        if sup is None and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            self._admit(pod)

    def _admit(self, pod: dict[str, Any]) -> None:
        assert self.network is not None
        meta = pod["metadata"]
        net = self.network.add_pod(meta["uid"], lambda ip: hosts_text(HostedPod.of(pod, ip, False, Path()), []))
        sup = PodSupervisor(
            pod=pod, netns=net.netns, pod_ip=net.ip, host_ip=self.network.gateway,
            workdir=self.workdir / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}",
            lookup=self._lookup(meta["namespace"]), post_status=self._post_pod_status,
            finish_deletion=self._finish_deletion, on_finished=self._forget, on_crash=self._crashed,
            base_env=self.base_env, image_env=self.image_env, entrypoints=self.entrypoints, token=self._token, service_env=self.service_env)
        with self._lock:
            self.pods[meta["uid"]] = sup
        sup.start()

    def _lookup(self, namespace: str):
        def lookup(kind: str, name: str) -> dict[str, str] | None:
            try:
                if kind == "ConfigMap":
                    return dict(self.core.read_namespaced_config_map(name, namespace).data or {})
                return decode_secret(self.core.read_namespaced_secret(name, namespace).data)
            except ApiException as e:
                if e.status == 404:
                    return None
                raise
        return lookup

    def _post_pod_status(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        meta = pod["metadata"]
        try:
            self.core.patch_namespaced_pod_status(meta["name"], meta["namespace"], {"status": status})
        except ApiException as e:
            if e.status != 404:
                raise

    def _finish_deletion(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        try:
            self.core.delete_namespaced_pod(meta["name"], meta["namespace"], grace_period_seconds=0,
                                            body={"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}})
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    def _crashed(self, sup: PodSupervisor, trace: str) -> None:
        # Kept in `pods` so that the next watch event does not admit the pod again.
        self.errors.append(f"supervisor of {sup.key} crashed:\n{trace}")

    def _forget(self, sup: PodSupervisor) -> None:
        uid = sup.pod["metadata"]["uid"]
        with self._lock:
            self.pods.pop(uid, None)
        if self.network is not None:
            self.network.remove_pod(uid)
