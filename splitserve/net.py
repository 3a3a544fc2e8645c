"""Small networking helpers shared by the launcher, tensor parallelism, tests and benchmarks."""

from __future__ import annotations

import itertools
import os
import random
import socket
import threading
from pathlib import Path

# Ports handed out start here: above the well-known services a machine commonly runs (up to ~10000).
FIRST_PORT = 15000
_lock = threading.Lock()
_candidates: itertools.cycle | None = None
_claimed: set[int] = set()          # ports this process was given (claim_port): never handed out


def claim_port(port: int) -> None:
    """Keep `port` from `free_port` in this process: it was given to something here (a flag's
    value) and may not be bound yet, so free_port could not see it is taken."""
    with _lock:
        _claimed.add(port)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` now, for a server this process is about to start.

    It comes from below the kernel's ephemeral range, never from it: a port the OS picks for
    `bind(port 0)` can be picked again for any outgoing connection (or another process's bind)
    before the server binds it, which a busy test machine did. Ports below the range are only
    taken on purpose. Each process walks the range from a random place, in its own slice under
    pytest-xdist, and skips a port something already holds and one `claim_port` was told of (a
    port given on the command line, not bound yet). Where the range leaves no room below it, the
    OS picks (the old way).
    """
    global _candidates
    with _lock:
        if _candidates is None:
            _candidates = itertools.cycle(_port_slice())
        for _ in range(1000):
            port = next(_candidates)
            if port is None:
                return _os_picked_port(host)
            if port not in _claimed and _bindable(host, port):
                return port
    return _os_picked_port(host)


def _port_slice() -> list[int | None]:
    low = _ephemeral_range()[0]
    if low - FIRST_PORT < 1000:
        return [None]
    ports = list(range(FIRST_PORT, low))
    worker, workers = _xdist_worker()
    share = len(ports) // workers
    ports = ports[worker * share:(worker + 1) * share]
    start = random.SystemRandom().randrange(len(ports))
    return ports[start:] + ports[:start]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999                    # Linux's default


def _xdist_worker() -> tuple[int, int]:
    """(this worker's index, how many) under pytest-xdist; (0, 1) elsewhere."""
    name, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if name.startswith("gw") and name[2:].isdigit() and count.isdigit() and int(name[2:]) < int(count):
        return int(name[2:]), int(count)
    return 0, 1


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _os_picked_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
