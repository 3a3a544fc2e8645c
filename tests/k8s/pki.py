"""Credentials for a throw-away control plane: a CA, the apiserver's serving
certificate, the service-account signing key and a static admin token.

Generated on the fly with `cryptography` (EC P-256 keys: milliseconds, where RSA
2048 takes a noticeable fraction of a second on these machines). Nothing here
is meant to outlive one test session; the files live in the session's
temporary folder.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Names the apiserver answers to, inside and outside the (simulated) cluster.
_SERVER_DNS_NAMES = ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                     "kubernetes.default.svc.cluster.local")
_SERVER_IPS = ("127.0.0.1", "10.96.0.1")
ADMIN_USER = "splitserve-test-admin"


@dataclass(frozen=True, slots=True)
class Credentials:
    """Paths of the generated files and the admin bearer token."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    sa_key: Path            # service-account signing key (private, PEM)
    sa_pub: Path            # its public half, which the apiserver verifies with
    token_file: Path        # --token-auth-file: one line for the admin
    admin_token: str


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return (x509.CertificateBuilder()
            .subject_name(subject).issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=2)))


def generate(folder: Path) -> Credentials:
    """Write a fresh CA, serving certificate, service-account key and token into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("splitserve-test-ca")
    ca_cert = (_builder(ca_name, ca_name, ca_key)
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))

    server_key = ec.generate_private_key(ec.SECP256R1())
    alt_names: list[x509.GeneralName] = [x509.DNSName(n) for n in _SERVER_DNS_NAMES]
    alt_names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in _SERVER_IPS]
    server_cert = (_builder(_name("kube-apiserver"), ca_name, server_key)
                   .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                   .sign(ca_key, hashes.SHA256()))

    sa_key = ec.generate_private_key(ec.SECP256R1())
    creds = Credentials(ca_cert=folder / "ca.crt", server_cert=folder / "apiserver.crt",
                        server_key=folder / "apiserver.key", sa_key=folder / "sa.key",
                        sa_pub=folder / "sa.pub", token_file=folder / "tokens.csv",
                        admin_token=secrets.token_hex(24))
    creds.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    creds.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(creds.server_key, server_key)
    _write_key(creds.sa_key, sa_key)
    creds.sa_pub.write_bytes(sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    # token,user,uid,"groups": system:masters bypasses RBAC (the admin of the test cluster).
    creds.token_file.write_text(f'{creds.admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')
    creds.token_file.chmod(0o600)
    return creds
