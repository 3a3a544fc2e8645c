"""Request limits: their configuration and the per-client admission bookkeeping.

`LimitsConfig` holds every limit with its default (0 turns a limit off):

- max_body_bytes (4 MiB): a larger HTTP body is refused with 413 before it is read whole;
- max_prompt_tokens (0: the model's context length): a longer prompt gets 400
  `context_length_exceeded` (the context check itself is the lifecycle's);
- max_concurrent_per_key (256): more requests in flight from one client get 429;
- rate_limit (0, off) requests per second per client with a burst of
  rate_limit_burst (default: one second's worth, at least 1): token bucket; 429
  with Retry-After when the bucket is empty;
- request_timeout_s (600): a request still running after this long is cancelled
  (its worker call too). Before any response byte: 504 with type "timeout";
  mid-stream: an in-band error event, then [DONE]. 504 and not 408, because the
  time ran out on the server's side (generation), not while the client was sending.

A "client" is the API key's id when keys are configured, else the peer's IP address.
`KeyLimiter.admit` decides and books a request; `finish` returns its slot. The
clock is injected so tests step it instead of sleeping.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_MAX_CONCURRENT_PER_KEY = 256
DEFAULT_REQUEST_TIMEOUT_S = 600.0
_MAX_CLIENTS = 100_000        # bucket table bound: idle full buckets are dropped beyond this


class Rejection(enum.Enum):
    """Why a request was refused: the `reason` label of the rejected-requests metric."""

    AUTH = "auth"
    RATE_LIMIT = "rate_limit"
    CONCURRENCY = "concurrency"
    BODY_TOO_LARGE = "body_too_large"
    INVALID = "invalid"
    TIMEOUT = "timeout"
    SHED = "shed"             # flow control had no room for it (flow_admission.py)


@dataclass(slots=True, frozen=True)
class LimitsConfig:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_tokens: int = 0
    max_concurrent_per_key: int = DEFAULT_MAX_CONCURRENT_PER_KEY
    rate_limit: float = 0.0
    rate_limit_burst: int = 0
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S

    def validate(self) -> None:
        """Raises ValueError naming the flag whose value cannot work."""
        for name in ("max_body_bytes", "max_prompt_tokens", "max_concurrent_per_key", "rate_limit_burst"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0 turns it off)")
        for name in ("rate_limit", "request_timeout_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"--{name.replace('_', '-').removesuffix('-s')} must be a finite number >= 0")

    @property
    def burst(self) -> int:
        return self.rate_limit_burst or max(1, math.ceil(self.rate_limit))


@dataclass(slots=True, frozen=True)
class Refusal:
    reason: Rejection
    message: str
    retry_after_s: int


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float
    in_flight: int = 0


@dataclass(slots=True)
class KeyLimiter:
    config: LimitsConfig
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def admit(self, client: str) -> Refusal | None:
        """Book one request for `client`; a Refusal (nothing booked) when a limit says no."""
        cfg, now = self.config, self.clock()
        bucket = self._buckets.get(client)
        if bucket is None:
            self._forget_idle()
            bucket = self._buckets[client] = _Bucket(float(cfg.burst), now)
        if cfg.max_concurrent_per_key and bucket.in_flight >= cfg.max_concurrent_per_key:
            return Refusal(Rejection.CONCURRENCY, f"too many concurrent requests: at most "
                           f"{cfg.max_concurrent_per_key} per client may run at once", 1)
        if cfg.rate_limit:
            bucket.tokens = min(float(cfg.burst), bucket.tokens + (now - bucket.updated) * cfg.rate_limit)
            bucket.updated = now
            if bucket.tokens < 1.0:
                wait = math.ceil((1.0 - bucket.tokens) / cfg.rate_limit)
                return Refusal(Rejection.RATE_LIMIT, f"rate limit exceeded: at most {cfg.rate_limit:g} "
                               f"requests per second per client (burst {cfg.burst}); retry in {wait} s", wait)
            bucket.tokens -= 1.0
        bucket.in_flight += 1
        return None

    def finish(self, client: str) -> None:
        bucket = self._buckets.get(client)
        if bucket is not None and bucket.in_flight > 0:
            bucket.in_flight -= 1

    def num_in_flight(self) -> int:
        """Requests booked and not finished (a leak check: 0 when idle)."""
        return sum(b.in_flight for b in self._buckets.values())

    def _forget_idle(self) -> None:
        if len(self._buckets) < _MAX_CLIENTS:
            return
        for client in [c for c, b in self._buckets.items() if b.in_flight == 0]:
            del self._buckets[client]


def check_prompt_tokens(num_prompt_tokens: int, limit: int, param: str) -> None:
    """Raise the 400 for a prompt over --max-prompt-tokens (0: no limit beyond the context length)."""
    if limit and num_prompt_tokens > limit:
        from splitserve.services.frontend.errors import invalid

        raise invalid(f"the prompt has {num_prompt_tokens} tokens; this server accepts at most {limit} "
                      "(--max-prompt-tokens)", param, "context_length_exceeded")


@dataclass(slots=True, frozen=True)
class PromptBound:
    """Refuses a text prompt that cannot fit before tokenizing it.

    No token of the vocabulary spells more than `max_token_chars` characters, so a text
    of more than limit × max_token_chars characters has more than `limit` tokens.
    Tokenizing a few megabytes takes seconds of the event loop's CPU; this check costs
    nothing and leaves every prompt that could fit to the exact token count.
    """

    max_token_chars: int

    @classmethod
    def of(cls, tokenizer) -> "PromptBound":
        longest = max((len(tokenizer.id_to_token(i) or "") for i in range(tokenizer.vocab_size)), default=1)
        return cls(max(longest, 1) + 1)      # +1: a leading-space marker some tokenizers add

    def check(self, num_chars: int, limit_tokens: int | None, param: str) -> None:
        if limit_tokens and num_chars > limit_tokens * self.max_token_chars:
            from splitserve.services.frontend.errors import invalid

            raise invalid(f"the prompt has {num_chars} characters, more than the {limit_tokens} tokens this "
                          "server accepts can spell", param, "context_length_exceeded")
