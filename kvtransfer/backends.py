"""The connector backends by name: `make_connector("tcp" | "nixl", ...)`.

Beside the connector API (connector.py) rather than in any one backend, so that
callers name a backend without importing it: each is imported only when asked
for, and the NIXL wheel is only needed by a worker that runs "nixl".
"""

from __future__ import annotations

import importlib.util

from splitserve.kvtransfer.connector import Connector
from splitserve.kvtransfer.layout import KVLayout


def make_connector(backend: str, name: str, layout: KVLayout, **kwargs) -> Connector:
    """A new connector named `name` for `layout`; `kwargs` go to the backend's constructor.
    Raises ValueError for an unknown backend."""
    if backend == "tcp":
        from splitserve.kvtransfer.tcp import TcpConnector
        return TcpConnector(name, layout, **kwargs)
    if backend == "nixl":
        from splitserve.kvtransfer.nixl_backend import NixlConnector
        return NixlConnector(name, layout, **kwargs)
    raise ValueError(f"unknown backend {backend!r}")


BACKENDS = ("nixl", "tcp")


def resolve_backend(name: str) -> str:
    """`auto` → nixl when its wheel is importable, else tcp."""
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(f"unknown KV transfer backend {name!r}; expected auto, nixl or tcp")
        return name
    for module in ("nixl_cu13", "nixl_cu12", "nixl"):
        if importlib.util.find_spec(module) is not None:
            return "nixl"
    return "tcp"
