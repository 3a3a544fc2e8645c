"""The public gRPC API's gatekeeper: API keys and per-client limits, as a server interceptor.

The same `Guard` as HTTP (guard.py). A call must carry `authorization: Bearer KEY`
metadata when keys are configured, else it ends with UNAUTHENTICATED before the
service sees it; streaming calls are then admitted by the per-client limiter
(RESOURCE_EXHAUSTED when over the concurrency or rate limit) and hold their slot
until the stream ends. Keys are never logged. gRPC clients bound their own calls
with deadlines, so the HTTP request timeout does not apply here.
"""

from __future__ import annotations

import logging

import grpc

from splitserve.services.frontend.guard import Guard
from splitserve.services.frontend.limits import Rejection

log = logging.getLogger(__name__)


def _peer_host(context) -> str:
    """The client's IP address, as HTTP names it: `ipv4:127.0.0.1:5000` → `127.0.0.1`,
    `ipv6:[::1]:5000` → `::1` (one client's HTTP and gRPC requests share their limits)."""
    peer = context.peer() or "unknown"
    _, _, address = peer.partition(":")
    host = address.rsplit(":", 1)[0] if address else peer
    return host.strip("[]")


class GuardInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, guard: Guard):
        self.guard = guard

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        key = None
        if self.guard.keys.enabled:
            header = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
            key = self.guard.keys.check_header(header if isinstance(header, str) else None)
            if key is None:
                log.info("refused gRPC %s: missing or unknown API key", details.method)
                self.guard.count("grpc", Rejection.AUTH)
                return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED,
                                 "invalid API key: send a configured key as 'authorization: Bearer KEY' metadata")
        if handler.unary_stream is None:
            return handler
        return grpc.unary_stream_rpc_method_handler(
            self._limited(handler.unary_stream, key), request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)

    def _limited(self, inner, key: str | None):
        guard = self.guard

        async def limited(request, context):
            client = key or _peer_host(context)
            refusal = guard.limiter.admit(client)
            log.debug("gRPC call from client %s: %s", client, "admitted" if refusal is None else refusal.reason.value)
            if refusal is not None:
                guard.count("grpc", refusal.reason)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.message)
            try:
                async for response in inner(request, context):
                    yield response
            finally:
                guard.limiter.finish(client)

        return limited


def _refusing(handler, code: grpc.StatusCode, message: str):
    """A handler of the same shape as `handler` that ends the call with `code`."""

    async def abort_unary(request, context):
        await context.abort(code, message)

    async def abort_stream(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(abort_stream, **kw)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(abort_stream, **kw)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(abort_unary, **kw)
    return grpc.unary_unary_rpc_method_handler(abort_unary, **kw)
