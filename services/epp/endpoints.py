"""Where the gateway sends a worker's traffic: each decode-capable worker's HTTP endpoint.

The router knows workers by their gRPC address (KV events, Stats); the gateway reaches a worker
pod's OpenAI API (its in-pod frontend, `splitserve frontend --gateway`) on the pool's target
port. A worker's endpoint is its host with the target port, unless one is given for it (several
workers on one host: `--endpoint GRPC_ADDRESS=HTTP_ADDRESS`; pods learned from the InferencePool
bring their own).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.errors import SplitserveError


def check_host_port(text: str, what: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SplitserveError(f"{what} {text!r}: expected HOST:PORT")
    return text


@dataclass(slots=True)
class EndpointBook:
    target_port: int = 8000
    overrides: dict[str, str] = field(default_factory=dict)     # gRPC address -> HTTP host:port

    @classmethod
    def parse(cls, target_port: int, pairs: list[str]) -> "EndpointBook":
        """From `--target-port` and `--endpoint GRPC=HTTP` flags; a SplitserveError for a bad one."""
        overrides = {}
        for pair in pairs:
            grpc_address, sep, http_address = pair.partition("=")
            if not sep:
                raise SplitserveError(f"--endpoint {pair!r}: expected GRPC_HOST:PORT=HTTP_HOST:PORT")
            overrides[check_host_port(grpc_address, "--endpoint")] = check_host_port(http_address, "--endpoint")
        return cls(target_port, overrides)

    def endpoint(self, grpc_address: str) -> str:
        known = self.overrides.get(grpc_address)
        if known is not None:
            return known
        host = grpc_address.rpartition(":")[0]
        return f"{host}:{self.target_port}"

    def set(self, grpc_address: str, http_address: str) -> None:
        self.overrides[grpc_address] = http_address

    def forget(self, grpc_address: str) -> None:
        self.overrides.pop(grpc_address, None)
