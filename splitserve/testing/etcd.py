"""A real etcd (Debian's etcd-server) on free loopback ports, for router discovery and fault tests.

It can be stopped and started again on the same ports with the same data directory (the
outage tests). A missing etcd binary fails, never skips: scripts/install-test-deps.sh
installs it.
"""

from __future__ import annotations

import json
import shutil
import ssl
import urllib.error
import urllib.request

from splitserve.net import free_port
from splitserve.testing.processes import Proc
from splitserve.testing.waiting import wait_until
from splitserve.tls import TlsConfig

START_TIMEOUT_S = 20.0


class Etcd:
    """One etcd member; `start()` waits until /health says so.

    With `tls` (a server certificate and key, and a CA), clients must connect over TLS and
    present a certificate that CA signed (`--client-cert-auth`), as in a hardened cluster."""

    def __init__(self, data_dir: str, tls: TlsConfig | None = None):
        if shutil.which("etcd") is None:
            raise AssertionError("etcd is not installed: run scripts/install-test-deps.sh (package etcd-server)")
        self.data_dir = data_dir
        self.tls = tls
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc: Proc | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        scheme = "https" if self.tls else "http"
        c, p = f"{scheme}://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        tls_args = [] if self.tls is None else [
            "--cert-file", self.tls.cert, "--key-file", self.tls.key, "--trusted-ca-file", self.tls.ca,
            "--client-cert-auth"]
        proc = self.proc = Proc.start(["etcd", "--name", "test", "--data-dir", self.data_dir,
                                "--listen-client-urls", c, "--advertise-client-urls", c,
                                "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
                                "--initial-cluster", f"test={p}", "--log-level", "warn", *tls_args])
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=self.tls.ca)
            context.load_cert_chain(self.tls.cert, self.tls.key)     # the server's own pair is a valid client

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{c}/health", timeout=1, context=context) as r:
                    return json.loads(r.read()).get("health") == "true"
            except (urllib.error.URLError, OSError, ValueError):
                return False

        wait_until(healthy, timeout=START_TIMEOUT_S, what="etcd to answer healthy",
                   details=lambda: "etcd output:\n" + proc.tail())

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None
