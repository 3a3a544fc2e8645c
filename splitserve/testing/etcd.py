"""A real etcd (Debian's etcd-server) on free loopback ports, for router discovery and fault tests.

It can be stopped and started again on the same ports with the same data directory (the
outage tests). A missing etcd binary fails, never skips: scripts/install-test-deps.sh
installs it.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request

from splitserve.net import free_port
from splitserve.testing.processes import Proc

START_TIMEOUT_S = 20.0


class Etcd:
    """One etcd member; `start()` waits until /health says so."""

    def __init__(self, data_dir: str):
        if shutil.which("etcd") is None:
            raise AssertionError("etcd is not installed: run scripts/install-test-deps.sh (package etcd-server)")
        self.data_dir = data_dir
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc: Proc | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        c, p = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        self.proc = Proc.start(["etcd", "--name", "test", "--data-dir", self.data_dir,
                                "--listen-client-urls", c, "--advertise-client-urls", c,
                                "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
                                "--initial-cluster", f"test={p}", "--log-level", "warn"])
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{c}/health", timeout=1) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.1)
        raise AssertionError("etcd did not start:\n" + self.proc.tail())

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None
