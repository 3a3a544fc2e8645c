"""Pod networking of the test node agent: network namespaces, a bridge, veth pairs.

Test infrastructure, part of the stand-in for kubelet + container runtime
(node_agent.py). A real node gives each pod a network namespace with an address
from the node's pod CIDR (the CNI plugin's job); here the agent does it with
iproute2:

- one "node" namespace per agent (`<prefix>-node`) holding a bridge `br0` with
  the CIDR's first address (the pods' gateway) and a MAC address of its own
  (`bridge_mac`; without one, Linux gives a bridge the lowest MAC of its ports,
  so a pod joining with a lower one changed the gateway's MAC under the pods
  already there, and their traffic through it was lost until their neighbour
  entries expired: 30-40 s of TCP retransmissions, about one run in three);
- one namespace per pod (`<prefix>-p<N>`) with `eth0` (the pod's IP) whose veth
  peer `vp<N>` sits on that bridge, so the pods of a node reach each other.

Everything lives inside namespaces the agent made (the project's network rule:
no pod address ever goes on the host's own interfaces); veth pairs are created
from inside the node namespace straight into the pod's, so not even a transient
interface appears on the host. `<prefix>` carries the agent's pid, which lets a
later run sweep the namespaces of a killed one (`sweep_stale_namespaces`).

`ip netns exec` bind-mounts /etc/netns/<ns>/<file> over /etc/<file> in the
process's own mount namespace, which is how a pod gets its /etc/hosts and
/etc/resolv.conf.
Sockets are opened inside a namespace by a short-lived thread that setns()es
(network namespaces are per thread) — no subprocess per probe.
"""

from __future__ import annotations

import ctypes
import hashlib
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

NETNS_DIR = Path("/run/netns")
ETC_NETNS = Path("/etc/netns")
NAME_PREFIX = "ssna"            # splitserve node agent
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


class NetworkSetupError(RuntimeError):
    """An iproute2 command failed (the message carries its stderr)."""


def ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    if check and proc.returncode != 0:
        raise NetworkSetupError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def kill_namespace_processes(netns: str) -> None:
    """SIGKILL whatever still runs inside `netns` (leftovers of a killed agent)."""
    out = ip("netns", "pids", netns, check=False).stdout.split()
    for pid in out:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def delete_namespace(netns: str) -> None:
    kill_namespace_processes(netns)
    ip("netns", "del", netns, check=False)
    shutil.rmtree(ETC_NETNS / netns, ignore_errors=True)


def sweep_stale_namespaces() -> list[str]:
    """Delete the namespaces (and /etc/netns files) of agents whose process is gone."""
    pattern = re.compile(rf"^{NAME_PREFIX}-(\d+)-")
    names = {p.name for p in NETNS_DIR.glob(f"{NAME_PREFIX}-*")} if NETNS_DIR.is_dir() else set()
    names |= {p.name for p in ETC_NETNS.glob(f"{NAME_PREFIX}-*")} if ETC_NETNS.is_dir() else set()
    swept = []
    for name in sorted(names):
        m = pattern.match(name)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue                    # its agent still runs (another test session)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        delete_namespace(name)
        swept.append(name)
    return swept


def socket_in_netns(netns: str, family: int = socket.AF_INET, type: int = socket.SOCK_STREAM) -> socket.socket:
    """A socket created inside `netns` (it keeps that namespace for its whole life)."""
    result: list[socket.socket | BaseException] = []

    def make() -> None:
        try:
            with open(NETNS_DIR / netns) as f:
                if _libc.setns(f.fileno(), _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({netns}): {os.strerror(err)}")
            result.append(socket.socket(family, type))
        except BaseException as e:  # handed to the caller's thread
            result.append(e)

    t = threading.Thread(target=make, name=f"setns-{netns}")
    t.start()
    t.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def connect_in_netns(netns: str, host: str, port: int, timeout: float) -> socket.socket:
    sock = socket_in_netns(netns)
    sock.settimeout(timeout)
    try:
        sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def bridge_mac(name: str) -> str:
    """A fixed, locally administered unicast MAC for the bridge of namespace `name`."""
    digest = hashlib.sha256(name.encode()).digest()[:5]
    return ":".join(f"{b:02x}" for b in (0x02, *digest))


def add_bridge(netns: str) -> None:
    """`br0` in `netns`, with its MAC set (module docstring), up."""
    ip("link", "add", "br0", "type", "bridge", netns=netns)
    ip("link", "set", "br0", "address", bridge_mac(netns), netns=netns)
    ip("link", "set", "br0", "up", netns=netns)


@dataclass(slots=True)
class PodNetwork:
    """One pod's namespace and address."""

    netns: str
    ip: str
    peer: str                   # the veth end on the node bridge


@dataclass(slots=True)
class NodeNetwork:
    """The node namespace with its bridge, and the pods attached to it."""

    prefix: str                 # ssna-<pid>-<n>
    pod_cidr: ipaddress.IPv4Network
    pods: dict[str, PodNetwork] = field(default_factory=dict)   # by pod uid
    _next_index: int = 2
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def netns(self) -> str:
        return f"{self.prefix}-node"

    @property
    def gateway(self) -> str:
        return str(self.pod_cidr.network_address + 1)

    def create(self) -> None:
        delete_namespace(self.netns)
        ip("netns", "add", self.netns)
        ip("link", "set", "lo", "up", netns=self.netns)
        add_bridge(self.netns)
        ip("addr", "add", f"{self.gateway}/{self.pod_cidr.prefixlen}", "dev", "br0", netns=self.netns)

    def add_pod(self, uid: str, hosts_for: Callable[[str], str]) -> PodNetwork:
        """A namespace for the pod, wired to the bridge; its /etc/hosts is `hosts_for(pod_ip)`."""
        with self._lock:
            index = self._next_index
            self._next_index += 1
        address = self.pod_cidr.network_address + index
        if address not in self.pod_cidr or address == self.pod_cidr.broadcast_address:
            raise NetworkSetupError(f"pod CIDR {self.pod_cidr} exhausted")
        pod = PodNetwork(netns=f"{self.prefix}-p{index}", ip=str(address), peer=f"vp{index}")
        delete_namespace(pod.netns)
        ip("netns", "add", pod.netns)
        ip("link", "set", "lo", "up", netns=pod.netns)
        ip("link", "add", pod.peer, "type", "veth", "peer", "name", "eth0", "netns", pod.netns,
           netns=self.netns)
        ip("link", "set", pod.peer, "master", "br0", "up", netns=self.netns)
        ip("addr", "add", f"{pod.ip}/{self.pod_cidr.prefixlen}", "dev", "eth0", netns=pod.netns)
        ip("link", "set", "eth0", "up", netns=pod.netns)
        ip("route", "add", "default", "via", self.gateway, netns=pod.netns)
        etc = ETC_NETNS / pod.netns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(hosts_for(pod.ip))
        # No cluster DNS yet. Without a resolv.conf of its own the pod would try the
        # host's nameservers, unreachable from here: every lookup (http.server's getfqdn
        # at bind) would hang for the resolver's timeouts. No nameserver line means
        # 127.0.0.1 in the pod's namespace: refused at once.
        (etc / "resolv.conf").write_text("# test node agent: no cluster DNS yet\noptions timeout:1 attempts:1\n")
        self.pods[uid] = pod
        return pod

    def remove_pod(self, uid: str) -> None:
        pod = self.pods.pop(uid, None)
        if pod is not None:
            delete_namespace(pod.netns)      # its veth pair goes with it

    def destroy(self) -> None:
        for uid in list(self.pods):
            self.remove_pod(uid)
        delete_namespace(self.netns)
        try:
            ETC_NETNS.rmdir()           # only when empty: other agents' files stay
        except OSError:
            pass


@dataclass(slots=True)
class ClusterNetwork:
    """Links the node namespaces of several agents: pods on different nodes reach each other.

    A namespace `<prefix>-cluster` holds a bridge; each node namespace gets an
    `uplink` veth onto it with an address in `transit` and forwards between its
    pod bridge and the uplink, with a route to every other node's pod CIDR via
    that node's uplink address — the flat, routed pod network of a real
    cluster (what a CNI such as flannel's host-gw mode sets up), inside namespaces.
    `agents` is the registry of the NodeAgents on it (name resolution spans them).
    """

    prefix: str
    transit: ipaddress.IPv4Network = ipaddress.ip_network("10.246.0.0/24")
    nodes: list[tuple[NodeNetwork, str]] = field(default_factory=list)   # (node, uplink address)
    agents: list = field(default_factory=list)
    _next: int = 1
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def netns(self) -> str:
        return f"{self.prefix}-cluster"

    def create(self) -> ClusterNetwork:
        delete_namespace(self.netns)
        ip("netns", "add", self.netns)
        ip("link", "set", "lo", "up", netns=self.netns)
        add_bridge(self.netns)           # its MAC fixed too: nodes join it as pods join theirs
        return self

    def attach(self, node: NodeNetwork) -> None:
        with self._lock:
            k, self._next = self._next, self._next + 1
            address = str(self.transit.network_address + k)
            ip("link", "add", f"up{k}", "type", "veth", "peer", "name", "uplink", "netns", node.netns,
               netns=self.netns)
            ip("link", "set", f"up{k}", "master", "br0", "up", netns=self.netns)
            ip("addr", "add", f"{address}/{self.transit.prefixlen}", "dev", "uplink", netns=node.netns)
            ip("link", "set", "uplink", "up", netns=node.netns)
            subprocess.run(["ip", "netns", "exec", node.netns, "sh", "-c",
                            "echo 1 > /proc/sys/net/ipv4/ip_forward"], check=True, timeout=20)
            for other, other_address in self.nodes:
                ip("route", "add", str(other.pod_cidr), "via", other_address, netns=node.netns)
                ip("route", "add", str(node.pod_cidr), "via", address, netns=other.netns)
            self.nodes.append((node, address))

    def detach(self, node: NodeNetwork) -> None:
        with self._lock:
            self.nodes = [(n, a) for n, a in self.nodes if n is not node]
            for other, _ in self.nodes:
                ip("route", "del", str(node.pod_cidr), netns=other.netns, check=False)
        # The uplink pair goes with the node's namespace.

    def destroy(self) -> None:
        delete_namespace(self.netns)
