"""Peer authentication for KV transfer: the deployment's shared token, proven, never sent.

Every agent of one deployment is given the same secret (`--transfer-token` or
`SPLITSERVE_TRANSFER_TOKEN`). It is never put on the wire; peers prove they hold
it with HMAC-SHA256 tags, compared in constant time:

- metadata: `AgentMetadata.auth` tags every field a sender will trust (name,
  incarnation, backend, address, layout hash, pool size, base addresses, the
  NIXL blob). `Connector.add_peer` checks the tag *before* the layout hash and
  before anything is loaded, so a sender never connects to, or loads the UCX
  metadata of, an agent outside the deployment;
- TCP connections: the receiver opens every accepted connection with a random
  nonce; the sender answers with its layout hash and a tag over (nonce, the
  receiver's incarnation, layout hash); the receiver checks both before it
  reads a single frame (challenge-response: a recorded answer does not replay);
- NIXL notifications: one-sided writes cannot be vetoed, but the completion
  notification carries a tag over its contents, so bytes from a sender without
  the token are never accepted as a request's KV.

Without a token (an empty one) tags are still computed and sent, but not
required: a receiver with a token refuses a peer without one, and vice versa.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from splitserve.kvtransfer.errors import PeerAuthError

__all__ = ["NONCE_BYTES", "PeerAuthError", "TAG_BYTES", "TOKEN_ENV", "new_nonce", "tag", "token_from", "verify"]

TOKEN_ENV = "SPLITSERVE_TRANSFER_TOKEN"
TAG_BYTES = 32
NONCE_BYTES = 32


def token_from(value: str | bytes | None, environ=None) -> bytes:
    """The token from a flag value, else the environment; b"" when neither is set."""
    if value:
        return value.encode() if isinstance(value, str) else value
    environ = os.environ if environ is None else environ
    return environ.get(TOKEN_ENV, "").strip().encode()


def tag(token: bytes, *parts: bytes | str | int) -> bytes:
    """HMAC-SHA256 over length-prefixed parts (so no two part lists collide)."""
    mac = hmac.new(token, digestmod=hashlib.sha256)
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        mac.update(len(data).to_bytes(8, "big"))
        mac.update(data)
    return mac.digest()


def verify(token: bytes, presented: bytes, *parts: bytes | str | int) -> bool:
    """True when the deployment has no token, or `presented` is the tag of `parts`."""
    if not token:
        return True
    return hmac.compare_digest(tag(token, *parts), presented)


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)
