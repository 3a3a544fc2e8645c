"""Command-line flags for API keys, limits, TLS and the KV transfer token, and what they build.

Shared by `splitserve frontend`, `worker` and `serve` (cli.py adds the groups;
the launcher forwards them). Secrets never travel on a command line that
`serve` builds: API keys and the transfer token reach the children through
the environment (SPLITSERVE_API_KEYS, SPLITSERVE_TRANSFER_TOKEN), which only
the same user can read.
"""

from __future__ import annotations

import argparse

from splitserve.errors import SplitserveError

from splitserve.services.frontend import limits as lim
from splitserve.tls import TlsConfig


def add_api_key_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("API keys (optional; /health, /ready, /metrics and /openapi.json stay open)")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="accept this key as 'Authorization: Bearer KEY' (HTTP) or 'authorization' metadata "
                        "(gRPC); repeatable. Prefer --api-keys-file or SPLITSERVE_API_KEYS: a flag shows in ps")
    g.add_argument("--api-keys-file", default=None, metavar="PATH",
                   help="file with one key a line (# comments); merged with --api-key and SPLITSERVE_API_KEYS")


def add_limit_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("limits (0 turns a limit off; 'client' = API key, or IP address without keys)")
    g.add_argument("--max-body-bytes", type=int, default=lim.DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help="larger HTTP bodies get 413 (default: %(default)s)")
    g.add_argument("--max-prompt-tokens", type=int, default=0, metavar="N",
                   help="longer prompts get 400 context_length_exceeded (default: 0, the model's context)")
    g.add_argument("--max-concurrent-per-key", type=int, default=lim.DEFAULT_MAX_CONCURRENT_PER_KEY, metavar="N",
                   help="requests one client may have in flight; more get 429 (default: %(default)s)")
    g.add_argument("--rate-limit", type=float, default=0.0, metavar="RPS",
                   help="requests per second per client (token bucket); over it: 429 with Retry-After "
                        "(default: 0, off)")
    g.add_argument("--rate-limit-burst", type=int, default=0, metavar="N",
                   help="bucket size (default: one second's worth, at least 1)")
    g.add_argument("--request-timeout", type=float, default=lim.DEFAULT_REQUEST_TIMEOUT_S, metavar="S",
                   help="cancel an HTTP request after this long: 504 type 'timeout' before the response "
                        "starts, an in-band error event mid-stream (default: %(default)s)")


def add_public_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS for clients (HTTPS and the public gRPC port)")
    g.add_argument("--tls-cert", default=None, metavar="PEM", help="the frontend's certificate chain")
    g.add_argument("--tls-key", default=None, metavar="PEM", help="its private key")


def add_frontend_worker_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mutual TLS to the workers")
    g.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="CA bundle the workers' certificates are checked against; turns on TLS to the workers")
    g.add_argument("--tls-client-cert", default=None, metavar="PEM",
                   help="certificate presented to the workers (default: --tls-cert)")
    g.add_argument("--tls-client-key", default=None, metavar="PEM", help="its key (default: --tls-key)")
    g.add_argument("--tls-server-name", default=None, metavar="NAME",
                   help="name expected in the workers' certificates when it is not the dialled host")


def add_worker_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mutual TLS (gRPC server and the channels to other workers)")
    g.add_argument("--tls-cert", default=None, metavar="PEM", help="this worker's certificate chain")
    g.add_argument("--tls-key", default=None, metavar="PEM", help="its private key")
    g.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="CA bundle; clients must present a certificate it signed (mutual TLS)")
    g.add_argument("--tls-server-name", default=None, metavar="NAME",
                   help="name expected in other workers' certificates when it is not the dialled host")


def add_etcd_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS to etcd (an etcd that serves https and requires client certificates)")
    g.add_argument("--etcd-ca", default=None, metavar="PEM", help="CA bundle that signed etcd's certificate "
                   "(turns TLS to etcd on)")
    g.add_argument("--etcd-cert", default=None, metavar="PEM",
                   help="client certificate chain to present to etcd (--client-cert-auth)")
    g.add_argument("--etcd-key", default=None, metavar="PEM", help="its private key")
    g.add_argument("--etcd-server-name", default=None, metavar="NAME",
                   help="name expected in etcd's certificate when it is not the dialled host")


def etcd_tls(args: argparse.Namespace) -> TlsConfig:
    if not args.etcd_ca:
        if args.etcd_cert or args.etcd_key or args.etcd_server_name:
            raise SplitserveError("--etcd-cert, --etcd-key and --etcd-server-name need --etcd-ca (etcd's CA)")
        return TlsConfig()
    tls = TlsConfig(cert=args.etcd_cert, key=args.etcd_key, ca=args.etcd_ca, server_name=args.etcd_server_name)
    tls.validate("--etcd")
    return tls


def add_transfer_token_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transfer-token", default=None, metavar="SECRET",
                   help="shared secret KV transfer peers must prove (default: SPLITSERVE_TRANSFER_TOKEN; "
                        "none: peers are not authenticated)")


def add_serve_tls_args(p: argparse.ArgumentParser) -> None:
    add_public_tls_args(p)
    g = p.add_argument_group("mutual TLS between the frontend and the workers")
    g.add_argument("--tls-ca", default=None, metavar="PEM", help="CA that signed --tls-internal-cert")
    g.add_argument("--tls-internal-cert", default=None, metavar="PEM",
                   help="certificate every worker serves and the frontend presents (client and server use)")
    g.add_argument("--tls-internal-key", default=None, metavar="PEM", help="its key")


# -- what the flags build ----------------------------------------------------------------
def limits_config(args: argparse.Namespace) -> lim.LimitsConfig:
    config = lim.LimitsConfig(max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                              max_concurrent_per_key=args.max_concurrent_per_key, rate_limit=args.rate_limit,
                              rate_limit_burst=args.rate_limit_burst, request_timeout_s=args.request_timeout)
    try:
        config.validate()
    except ValueError as exc:
        raise SplitserveError(str(exc)) from None
    return config


def public_tls(args: argparse.Namespace) -> TlsConfig:
    tls = TlsConfig(cert=args.tls_cert, key=args.tls_key)
    tls.validate()
    return tls


def frontend_worker_tls(args: argparse.Namespace) -> TlsConfig:
    if not args.tls_ca:
        if args.tls_client_cert or args.tls_client_key:
            raise SplitserveError("--tls-client-cert/--tls-client-key need --tls-ca (the workers' CA)")
        return TlsConfig()
    tls = TlsConfig(cert=args.tls_client_cert or args.tls_cert, key=args.tls_client_key or args.tls_key,
                    ca=args.tls_ca, server_name=args.tls_server_name)
    tls.validate("--tls-client")
    return tls


def worker_tls(args: argparse.Namespace) -> TlsConfig:
    tls = TlsConfig(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca, server_name=args.tls_server_name)
    tls.validate()
    if tls.ca and not tls.cert:
        raise SplitserveError("--tls-ca on a worker needs --tls-cert and --tls-key (its server certificate)")
    return tls


def check_serve_args(args: argparse.Namespace) -> None:
    """Contradictions `serve` refuses before starting anything."""
    TlsConfig(cert=args.tls_cert, key=args.tls_key).validate()
    TlsConfig(cert=args.tls_internal_cert, key=args.tls_internal_key, ca=args.tls_ca).validate("--tls-internal")
    if bool(args.tls_ca) != bool(args.tls_internal_cert):
        raise SplitserveError("--tls-ca and --tls-internal-cert/--tls-internal-key go together")
    limits_config(args)
