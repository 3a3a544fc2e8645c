"""Optional API keys for the HTTP and gRPC APIs: where they come from and how one is checked.

Keys come from `--api-key` (repeatable), `--api-keys-file` (one key a line; blank
lines and lines starting with `#` are skipped) and the `SPLITSERVE_API_KEYS`
environment variable (comma- or whitespace-separated); all three are merged. No
key configured means the API is open.

A presented key is compared against every configured key with
`hmac.compare_digest` over their SHA-256 digests, so the time taken depends
neither on where the first differing byte is nor on which key matched. The key
itself is never stored beyond this object and never logged: requests are known
to the rate limiter and to logs by `key_id`, a short digest prefix.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.errors import SplitserveError

ENV_VAR = "SPLITSERVE_API_KEYS"
BEARER = "bearer "


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def key_id(key: str) -> str:
    """A non-reversible label for a key (logs, limiter buckets): 12 hex digits of its SHA-256."""
    return "key-" + _digest(key).hex()[:12]


@dataclass(slots=True)
class ApiKeys:
    digests: list[bytes] = field(default_factory=list)

    @classmethod
    def load(cls, keys: list[str] | None = None, keys_file: str | None = None,
             environ: dict[str, str] | None = None) -> "ApiKeys":
        """Merge the flag, file and environment sources; raises SplitserveError for an unreadable file."""
        environ = os.environ if environ is None else environ
        found = [k.strip() for k in keys or []]
        if keys_file:
            try:
                lines = Path(keys_file).read_text().splitlines()
            except OSError as exc:
                raise SplitserveError(f"cannot read --api-keys-file {keys_file}: {exc.strerror}") from None
            found += [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        found += environ.get(ENV_VAR, "").replace(",", " ").split()
        return cls([_digest(k) for k in dict.fromkeys(k for k in found if k)])

    @property
    def enabled(self) -> bool:
        return bool(self.digests)

    def check(self, presented: str | None) -> str | None:
        """The key's id when `presented` is a configured key, else None (constant time per key)."""
        if presented is None:
            return None
        digest = _digest(presented)
        matched = False
        for known in self.digests:          # no early exit: every key is compared
            matched |= hmac.compare_digest(digest, known)
        return "key-" + digest.hex()[:12] if matched else None

    def check_header(self, value: str | None) -> str | None:
        """`Authorization: Bearer KEY` (the scheme is case-insensitive) → key id or None."""
        if not value or not value[:len(BEARER)].lower() == BEARER:
            return None
        return self.check(value[len(BEARER):].strip())
