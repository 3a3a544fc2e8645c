"""How `serve --autoscale`'s frontends learn of the workers it adds and removes: a local etcd.

`serve` starts an etcd member on loopback (free client and peer ports, a temporary data
directory removed on exit), supervised like any child (restarted on the same ports and data
directory); every worker gets `--etcd` and every frontend `--etcd` instead of a `--worker`
list. This is the discovery the Kubernetes deployment already uses (splitserve/discovery/etcd.py),
chosen over a membership file or list that `serve` would edit because the worker's own
lifecycle already orders it as scaling needs, with no change to the frontend:

- a worker registers only once it is SERVING (services/worker/server.py), so a frontend adds
  it when it can take requests, and its health watch marks it ready;
- on SIGTERM a worker turns NOT_SERVING first (the frontends' health watches stop routing
  to it), lets its running requests finish (up to --drain-timeout; what is left then fails
  with UNAVAILABLE and the frontend migrates it), and revokes its registration only after
  that (services/worker/shutdown.py), so a frontend never closes the channel of a stream
  still running; the frontend's pool then removes it (workers/pool.py: reconcile);
- a worker that dies without draining leaves when its lease runs out (10 s); the supervisor
  restarts it at the same address meanwhile, under the same key.

The cost is the `etcd` binary (Debian/Ubuntu: etcd-server), checked before anything starts.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.errors import SplitserveError
from splitserve.net import free_port

ETCD_BINARY = "etcd"
POLL_S = 0.1
# etcd's own gRPC client (its gateway) logs a warning when it stops, at grpc-go's default level.
ETCD_ENV = {"GRPC_GO_LOG_SEVERITY_LEVEL": "error"}


def etcd_binary() -> str:
    path = shutil.which(ETCD_BINARY)
    if path is None:
        raise SplitserveError("--autoscale needs the etcd binary on PATH: the frontends learn of the workers it "
                              "adds and removes through a local etcd (Debian/Ubuntu: apt-get install "
                              "etcd-server; or https://etcd.io/docs/latest/install/)")
    return path


@dataclass(slots=True)
class LocalEtcd:
    binary: str
    data_dir: str
    client_port: int
    peer_port: int

    @classmethod
    def plan(cls) -> LocalEtcd:
        return cls(etcd_binary(), tempfile.mkdtemp(prefix="splitserve-etcd-"), free_port(), free_port())

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def argv(self) -> list[str]:
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        return [self.binary, "--name", "splitserve", "--data-dir", self.data_dir,
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"splitserve={peer}", "--logger", "zap", "--log-level", "error"]

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1.0) as reply:
                return json.loads(reply.read()).get("health") == "true"
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_healthy(self, timeout_s: float, check_alive: Callable[[], None]) -> None:
        start = time.monotonic()
        while not self.healthy():
            check_alive()
            if time.monotonic() - start > timeout_s:
                raise SplitserveError(f"the local etcd is not healthy after {timeout_s:.0f} s")
            time.sleep(POLL_S)

    def remove_data(self) -> None:
        shutil.rmtree(self.data_dir, ignore_errors=True)
