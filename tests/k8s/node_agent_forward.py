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

Threads, not asyncio: the relays are plain byte pumps beside the agent's
other threads; one thread per direction per connection is plenty for tests.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field

from node_agent_net import socket_in_netns


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


@dataclass(slots=True)
class HostPortForward:
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
        listener = socket_in_netns(self.netns)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.node_ip, self.listen_port))
        listener.listen(64)
        listener.settimeout(0.5)          # so the accept loop sees stop()
        self.listen_port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, name=f"forward-{self.address}", daemon=True).start()
        return self

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
                outside = socket.create_connection(("127.0.0.1", self.host_port), timeout=5)
            except OSError:
                inside.close()
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
