"""Name resolution for the test node agent's pods: /etc/hosts in place of cluster DNS.

Test infrastructure, part of the stand-in for kubelet + container runtime
(node_agent.py). There is no cluster DNS; instead each pod's /etc/hosts
carries what DNS would answer for the pods the agent runs:

- the pod itself (kubelet's own entry): its IP, hostname, and
  `<hostname>.<subdomain>.<ns>.svc.cluster.local` when it has a subdomain;
- a headless Service (clusterIP None) with a selector: every selected pod
  (ready ones only, unless `publishNotReadyAddresses`) under the Service's name,
  and, when the pod's `subdomain` is that Service, under
  `<hostname>.<service>.<ns>.svc.cluster.local` — the names the operator gives
  a tensor-parallel group's leader. Shorter forms (`<hostname>.<service>`,
  `<service>`) are written for pods of the same namespace, since /etc/hosts
  gets no search-domain expansion.

Only pods the agents know are named: this agent's, and those of the other
agents on the same ClusterNetwork (pods on kwok nodes have addresses nothing
can reach).
The file is rewritten in place: `ip netns exec` bind-mounted that very inode
over the process's /etc/hosts, so a rename would go unseen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLUSTER_DOMAIN = "cluster.local"
_HEADER = ["# written by the splitserve test node agent (kubelet's /etc/hosts + what cluster DNS would answer)",
           "127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]


@dataclass(slots=True)
class HostedPod:
    """What name resolution needs of one pod the agent runs."""

    namespace: str
    name: str
    ip: str
    labels: dict[str, str]
    hostname: str
    subdomain: str
    ready: bool
    hosts_path: Path

    @classmethod
    def of(cls, pod: dict[str, Any], ip: str, ready: bool, hosts_path: Path) -> HostedPod:
        meta, spec = pod["metadata"], pod["spec"]
        return cls(namespace=meta["namespace"], name=meta["name"], ip=ip, labels=dict(meta.get("labels") or {}),
                   hostname=spec.get("hostname") or meta["name"], subdomain=spec.get("subdomain") or "",
                   ready=ready, hosts_path=hosts_path)


@dataclass(slots=True)
class Record:
    """An address and its names, by namespace (short forms apply only there)."""

    ip: str
    namespace: str
    fqdns: list[str]
    short: list[str] = field(default_factory=list)


def _selects(service: dict[str, Any], pod: HostedPod) -> bool:
    selector = (service.get("spec") or {}).get("selector") or {}
    return bool(selector) and all(pod.labels.get(k) == v for k, v in selector.items())


def service_records(pods: list[HostedPod], services: list[dict[str, Any]]) -> list[Record]:
    records = []
    for svc in services:
        spec, meta = svc.get("spec") or {}, svc["metadata"]
        if spec.get("clusterIP") != "None":
            continue                     # a ClusterIP Service needs a proxy: not done
        name, ns = meta["name"], meta["namespace"]
        base = f"{name}.{ns}.svc.{CLUSTER_DOMAIN}"
        for pod in pods:
            if pod.namespace != ns or not _selects(svc, pod):
                continue
            if not (pod.ready or spec.get("publishNotReadyAddresses")):
                continue
            records.append(Record(pod.ip, ns, [base], [name]))
            if pod.subdomain == name:
                records.append(Record(pod.ip, ns, [f"{pod.hostname}.{base}"], [f"{pod.hostname}.{name}"]))
    return records


def hosts_text(pod: HostedPod, records: list[Record]) -> str:
    own = [pod.hostname]
    if pod.subdomain:
        own.insert(0, f"{pod.hostname}.{pod.subdomain}.{pod.namespace}.svc.{CLUSTER_DOMAIN}")
    lines = [*_HEADER, f"{pod.ip}\t{' '.join(own)}"]
    for r in records:
        names = [*r.fqdns, *(r.short if r.namespace == pod.namespace else [])]
        lines.append(f"{r.ip}\t{' '.join(names)}")
    return "\n".join(lines) + "\n"


def write_in_place(path: Path, text: str) -> bool:
    """Rewrite the file keeping its inode (see the module docstring); True when it changed."""
    try:
        if path.read_text() == text:
            return False
    except FileNotFoundError:
        pass
    with open(path, "r+" if path.exists() else "w") as f:
        f.seek(0)
        f.write(text)
        f.truncate()
    return True
