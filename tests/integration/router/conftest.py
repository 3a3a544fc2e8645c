"""A real etcd server and real worker/frontend processes for the router tests.

etcd comes from Debian's etcd-server package (scripts/install-test-deps.sh); it
listens on random ports on 127.0.0.1 with a temporary data directory and can
be stopped and restarted on the same ports (the outage test). A missing etcd
fails the tests, never skips them.
"""

from __future__ import annotations

import json
import urllib.request

from splitserve.net import free_port  # noqa: F401 - the test modules import it from here
from splitserve.testing.processes import Proc  # noqa: F401 - the test modules import it from here


def http_json(url: str, body: dict | None = None, timeout: float = 30.0):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as reply:
        text = reply.read()
    return json.loads(text) if text[:1] in b"{[" else text.decode()
