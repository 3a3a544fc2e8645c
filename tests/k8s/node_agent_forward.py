"""Host servers made reachable from pods: a TCP forward from the node namespace to 127.0.0.1.

Test infrastructure, part of the stand-in for kubelet + container runtime
(node_agent.py). The test control plane's servers (etcd, the apiserver) listen
on the host's 127.0.0.1, which no pod namespace can reach. `HostPortForward`
listens inside the agent's node namespace, on the node's address (the pods'
gateway, reachable from every pod of the node and, over a ClusterNetwork,
from every linked node), and relays each connection to a 127.0.0.1 port of the
host. The listener is inside a namespace the test made and the host side is a
loopback connect, so the network rule holds (nothing listens on the host's own
interfaces).

`IntoClusterForward` is the other way: a listener on the host's 127.0.0.1
relaying into the node namespace (to a pod IP, or a ready endpoint of a
Service), as `kubectl port-forward` gives a client outside the cluster.

Threads, not asyncio: the relays are plain byte pumps beside the agent's
other threads; one thread per direction per connection is plenty for tests.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from node_agent_net import connect_in_netns, socket_in_netns


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)    # pass the half-close on (gRPC and HTTP both care)
        except OSError:
            pass


class _Relay:
    """Accept connections on a listener; for each, dial the other side and pump both ways."""

    _listener: socket.socket | None
    _stop: threading.Event
    _conns: list[socket.socket]

    def _serve(self, listener: socket.socket, host: str, port: int, name: str) -> int:
        """Bind `listener` to host:port (0: any), start accepting; the port it got."""
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(64)
        listener.settimeout(0.5)          # so the accept loop sees stop()
        self._listener = listener
        threading.Thread(target=self._accept, name=name, daemon=True).start()
        return listener.getsockname()[1]

    def _dial(self) -> socket.socket | None:
        raise NotImplementedError

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                inside, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            inside.settimeout(None)
            try:
                outside = self._dial()
            except OSError:
                outside = None
            if outside is None:
                inside.close()            # nothing to reach: refused, as a Service without endpoints
                continue
            outside.settimeout(None)
            self._conns += [inside, outside]
            for a, b in ((inside, outside), (outside, inside)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        for s in self._conns:
            try:
                s.close()
            except OSError:
                pass


@dataclass(slots=True)
class HostPortForward(_Relay):
    """`node_ip:listen_port` inside `netns` relayed to `127.0.0.1:host_port` on the host."""

    netns: str
    node_ip: str
    host_port: int
    listen_port: int = 0              # 0: any free port in the namespace
    _listener: socket.socket | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _conns: list[socket.socket] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.node_ip}:{self.listen_port}"

    def start(self) -> HostPortForward:
        self.listen_port = self._serve(socket_in_netns(self.netns), self.node_ip, self.listen_port,
                                       f"forward-{self.netns}-{self.node_ip}")
        return self

    def _dial(self) -> socket.socket | None:
        return socket.create_connection(("127.0.0.1", self.host_port), timeout=5)


@dataclass(slots=True)
class IntoClusterForward(_Relay):
    """The host's `127.0.0.1:<port>` relayed into `netns`: each connection to `target()`
    (an address the node namespace reaches: a pod IP, over the bridge), or refused when
    it returns None. The stand-in for `kubectl port-forward`."""

    netns: str
    target: Callable[[], tuple[str, int] | None]
    port: int = 0
    _listener: socket.socket | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _conns: list[socket.socket] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> IntoClusterForward:
        self.port = self._serve(socket.socket(socket.AF_INET, socket.SOCK_STREAM), "127.0.0.1", self.port,
                                f"into-cluster-{self.netns}")
        return self

    def _dial(self) -> socket.socket | None:
        where = self.target()
        return None if where is None else connect_in_netns(self.netns, where[0], where[1], timeout=5)
