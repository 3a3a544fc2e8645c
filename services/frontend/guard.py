"""The HTTP API's gatekeeper: API keys, body size, per-client limits, the request timeout.

A pure ASGI middleware in front of the FastAPI app, so that it sees every
request before the app does and every response status after. In order:

1. /health, /ready, /metrics and /openapi.json are open: no key, no limits.
2. API key (when keys are configured): `Authorization: Bearer KEY`, else 401
   `invalid_api_key`. The key is never logged; only its id (auth.key_id) is.
3. Generation requests (POST /v1/...) and POST /tokenize, /detokenize (the text work is
   the frontend's CPU, so they are bounded the same way): per-client concurrency and rate (429 with
   Retry-After), then the body is read here, at most max_body_bytes (413 beyond,
   checked against Content-Length first), and replayed to the app.
4. The rest of the request runs under request_timeout_s (limits.py says what a
   timeout answers).

Every refusal, whether made here or a 4xx from the app (counted as "invalid", or "shed" for
flow control's 429, which carries x-llm-d-request-dropped-reason), increments
`splitserve_rejected_requests{protocol="http", reason}`. With keys on, the app finds the
request's key id in the scope under KEY_ID_SCOPE (flow control's flow, flow_headers.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.services.flow_control import DROPPED_REASON_HEADER

from splitserve.services.frontend.asgi import DONE, Receive, Scope, Send, event, send_json
from splitserve.services.frontend.auth import ApiKeys
from splitserve.services.frontend.errors import APIError
from splitserve.services.frontend.limits import KeyLimiter, LimitsConfig, Rejection

log = logging.getLogger(__name__)

DRAIN_FACTOR = 16          # an over-limit body this many times the limit is still read (and dropped)
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/openapi.json"})
KEY_ID_SCOPE = "splitserve.key_id"      # the scope entry that names an admitted request's API key id
SHED_HEADER = DROPPED_REASON_HEADER.encode()
LIMITED_ROOT_PATHS = frozenset({"/tokenize", "/detokenize", "/invocations"})   # limited like POST /v1/...



@dataclass(slots=True)
class Guard:
    """What the gatekeeper enforces; shared by the HTTP middleware and the gRPC interceptor."""

    keys: ApiKeys = field(default_factory=ApiKeys)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    rejected: object = None          # Counter(protocol, reason), or None (not counted)
    clock: Callable[[], float] = time.monotonic     # the rate limiter's (tests step it)
    limiter: KeyLimiter = field(init=False)

    def __post_init__(self) -> None:
        self.limiter = KeyLimiter(self.limits, self.clock)

    def count(self, protocol: str, reason: Rejection) -> None:
        if self.rejected is not None:
            self.rejected.labels(protocol, reason.value).inc()


class GuardMiddleware:
    def __init__(self, app, guard: Guard):
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        guard = self.guard
        client = (scope.get("client") or ("unknown", 0))[0]
        if guard.keys.enabled:
            key = guard.keys.check_header(_headers(scope).get("authorization"))
            if key is None:
                log.info("refused %s %s from %s: missing or unknown API key", scope["method"], scope["path"], client)
                await self._refuse(send, Rejection.AUTH, APIError(
                    401, "invalid API key: send a configured key as 'Authorization: Bearer KEY'",
                    code="invalid_api_key"), {"www-authenticate": "Bearer"})
                return
            client = key
            scope[KEY_ID_SCOPE] = key
        if scope["method"] != "POST" or not (scope["path"].startswith("/v1/")
                                             or scope["path"] in LIMITED_ROOT_PATHS):
            await self._run(scope, receive, send)
            return
        refusal = guard.limiter.admit(client)
        if refusal is not None:
            await self._refuse(send, refusal.reason, APIError(429, refusal.message, type="rate_limit_error",
                                                              code=refusal.reason.value),
                               {"retry-after": str(refusal.retry_after_s)})
            return
        log.debug("%s %s: client %s admitted", scope["method"], scope["path"], client)
        try:
            await self._run(scope, receive, send, limit_body=True)
        finally:
            guard.limiter.finish(client)
            log.debug("%s %s: client %s done", scope["method"], scope["path"], client)

    async def _run(self, scope: Scope, receive: Receive, send: Send, limit_body: bool = False) -> None:
        state = _ResponseState()

        async def observe(message: dict) -> None:
            if message["type"] == "http.response.start":
                state.started = True
                state.streaming = _header(message, b"content-type").startswith(b"text/event-stream")
                if 400 <= message["status"] < 500:
                    self.guard.count("http", Rejection.SHED if _header(message, SHED_HEADER) else Rejection.INVALID)
            await send(message)

        async def body_then_app() -> None:
            inner = receive
            if limit_body:
                body = await self._read_body(scope, receive, send)
                if body is None:
                    return
                inner = _replay(body, receive)
            await self.app(scope, inner, observe)

        timeout = self.guard.limits.request_timeout_s
        try:
            async with asyncio.timeout(timeout or None):
                await body_then_app()
        except TimeoutError:
            log.warning("request %s %s: timed out after %.0f s, cancelled", scope["method"], scope["path"], timeout)
            self.guard.count("http", Rejection.TIMEOUT)
            await self._timed_out(send, state, timeout)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None after answering 413 (or when the client went away)."""
        limit = self.guard.limits.max_body_bytes
        declared = _headers(scope).get("content-length") if limit else None
        if limit and declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse_body(receive, send, limit, int(declared) <= DRAIN_FACTOR * limit)
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if limit and size > limit:
                await self._refuse_body(receive, send, limit, message.get("more_body", False))
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse_body(self, receive: Receive, send: Send, limit: int, drain: bool) -> None:
        """413. A body up to DRAIN_FACTOR × the limit is read and dropped first: closing on unread
        bytes makes the kernel reset the connection, and the client would see that, not the 413."""
        budget = DRAIN_FACTOR * limit
        while drain and budget > 0:
            message = await receive()
            budget -= len(message.get("body", b""))
            drain = message["type"] == "http.request" and message.get("more_body", False)
        await self._refuse(send, Rejection.BODY_TOO_LARGE, _too_large(limit), {"connection": "close"})

    async def _refuse(self, send: Send, reason: Rejection, error: APIError, extra: dict | None = None) -> None:
        self.guard.count("http", reason)
        await send_json(send, error.status, error.body(),
                        [(k.encode(), v.encode()) for k, v in (extra or {}).items()])

    async def _timed_out(self, send: Send, state: "_ResponseState", timeout: float) -> None:
        error = APIError(504, f"the request did not finish within the server's {timeout:g} s request timeout "
                              "and was cancelled", type="timeout", code="request_timeout")
        if not state.started:
            await send_json(send, error.status, error.body())
        elif state.streaming:
            await send({"type": "http.response.body", "body": event(error.body()) + DONE, "more_body": False})
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


@dataclass(slots=True)
class _ResponseState:
    started: bool = False
    streaming: bool = False


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}


def _header(message: dict, name: bytes) -> bytes:
    for k, v in message.get("headers", ()):
        if k.lower() == name:
            return v
    return b""


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                    code="request_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields the buffered body once, then the client's later messages (disconnect)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay

