"""TLS material from files, turned into gRPC, asyncio and uvicorn credentials. Shared by every process.

One `TlsConfig` describes one side of one kind of connection:

- cert + key: the PEM chain and key this process presents (as a server, or as a
  client when the other side asks for one);
- ca: the PEM bundle peers are verified against. On a server it also makes a
  client certificate *required* (mutual TLS); on a channel it replaces the system
  roots;
- server_name: on channels, the name expected in the server's certificate when
  it differs from the host dialled (pods are dialled by IP; their certificates
  name a service).

Files are read when credentials are built (at start-up and for each new
channel), so a rotated Secret is picked up by new connections. An empty config
means plaintext: `aio_channel` then opens an insecure channel and `add_port` an
insecure port, so callers have a single code path.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from splitserve.errors import SplitserveError


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SplitserveError(f"cannot read the TLS {what} {path}: {exc.strerror}") from None


@dataclass(slots=True, frozen=True)
class PemMaterial:
    ca: bytes | None
    cert: bytes | None
    key: bytes | None


@dataclass(slots=True, frozen=True)
class TlsConfig:
    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)

    @classmethod
    def client_from_env(cls, environ=None) -> "TlsConfig":
        """The client side of mutual TLS to the workers from SPLITSERVE_TLS_{CA,CLIENT_CERT,CLIENT_KEY,
        SERVER_NAME} (the operator and the readiness probe, whose pods mount them from a Secret)."""
        import os

        env = os.environ if environ is None else environ
        return cls(cert=env.get("SPLITSERVE_TLS_CLIENT_CERT") or None, key=env.get("SPLITSERVE_TLS_CLIENT_KEY") or None,
                   ca=env.get("SPLITSERVE_TLS_CA") or None, server_name=env.get("SPLITSERVE_TLS_SERVER_NAME") or None)

    def validate(self, flag_prefix: str = "--tls") -> None:
        """Raises SplitserveError when cert and key are not given together or a file is unreadable."""
        if bool(self.cert) != bool(self.key):
            raise SplitserveError(f"{flag_prefix}-cert and {flag_prefix}-key go together")
        for path, what in ((self.cert, "certificate"), (self.key, "key"), (self.ca, "CA bundle")):
            if path:
                _read(path, what)

    # -- gRPC servers ------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials:
        """The server's certificate; with `ca`, clients must present a certificate it signed."""
        if not self.cert:
            raise SplitserveError("a TLS server needs a certificate and key")
        ca = _read(self.ca, "CA bundle") if self.ca else None
        return grpc.ssl_server_credentials([(_read(self.key, "key"), _read(self.cert, "certificate"))],
                                           root_certificates=ca, require_client_auth=ca is not None)

    def add_port(self, server, address: str) -> int:
        """Bind `address` on a grpc(.aio) server, with TLS when a certificate is configured; 0 on failure."""
        if self.cert:
            return server.add_secure_port(address, self.server_credentials())
        return server.add_insecure_port(address)

    # -- gRPC channels -----------------------------------------------------------------
    def pem_material(self) -> "PemMaterial":
        """The files' bytes, for clients that take PEM rather than credentials (etcd3aio)."""
        return PemMaterial(ca=_read(self.ca, "CA bundle") if self.ca else None,
                           cert=_read(self.cert, "certificate") if self.cert else None,
                           key=_read(self.key, "key") if self.key else None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca = _read(self.ca, "CA bundle") if self.ca else None
        key = _read(self.key, "key") if self.key else None
        chain = _read(self.cert, "certificate") if self.cert else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=chain)

    def channel_options(self, options=()) -> list[tuple[str, object]]:
        extra = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return [*options, *extra]

    def aio_channel(self, address: str, options=()) -> grpc.aio.Channel:
        if not self.enabled:
            return grpc.aio.insecure_channel(address, options=list(options))
        return grpc.aio.secure_channel(address, self.channel_credentials(), options=self.channel_options(options))

    def channel(self, address: str, options=()) -> grpc.Channel:
        """A blocking channel (the launcher's readiness checks)."""
        if not self.enabled:
            return grpc.insecure_channel(address, options=list(options))
        return grpc.secure_channel(address, self.channel_credentials(), options=self.channel_options(options))

    # -- plain streams (the workers' session stream) -----------------------------------
    def server_ssl_context(self) -> ssl.SSLContext | None:
        """The asyncio server side of the same TLS as `server_credentials`; None for plaintext."""
        if not self.cert:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        if self.ca:
            context.load_verify_locations(cafile=self.ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_ssl_context(self) -> ssl.SSLContext | None:
        """The asyncio client side of the same TLS as `channel_credentials`; None for plaintext."""
        if not self.enabled:
            return None
        context = ssl.create_default_context(cafile=self.ca)
        if self.cert:
            context.load_cert_chain(self.cert, self.key)
        return context

    def server_hostname(self, host: str) -> str | None:
        """The name to check the server's certificate against (`server_name` overrides the host)."""
        return (self.server_name or host) if self.enabled else None

    # -- HTTP ----------------------------------------------------------------------------
    def uvicorn_kwargs(self) -> dict:
        """uvicorn.Config arguments for HTTPS (empty: plain HTTP)."""
        if not self.cert:
            return {}
        kwargs = {"ssl_certfile": self.cert, "ssl_keyfile": self.key}
        if self.ca:
            kwargs.update(ssl_ca_certs=self.ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return kwargs


PLAINTEXT = TlsConfig()
