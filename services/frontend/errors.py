"""OpenAI-style errors: every refusal is `{"error": {message, type, param, code}}` with a 4xx.

`APIError` is raised anywhere in the request path and turned into that body by
the app's exception handlers, which also cover malformed JSON, schema
violations, unknown routes and (as a last resort, for bugs) anything else.
"""

from __future__ import annotations

import logging

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class APIError(Exception):
    """`headers`: response headers the refusal carries besides its body (a shed request's
    Retry-After and x-llm-d-request-dropped-reason); lower-case names."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def header_pairs(self) -> list[tuple[bytes, bytes]]:
        """`headers` as ASGI header pairs."""
        return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in self.headers.items()]


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "body"}


def _is_field(part) -> bool:
    """Drop the union-member tags pydantic puts in error locations ('constrained-str', 'list[int]')."""
    if isinstance(part, int):
        return True
    return part.isidentifier() and part not in _TYPE_TAGS


def from_validation_error(exc: ValidationError) -> APIError:
    """The first schema violation, phrased for a client."""
    err = exc.errors(include_url=False)[0]
    loc = [str(part) for part in err.get("loc", ()) if _is_field(part)]
    param = ".".join(loc) or None
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return invalid(f"unsupported parameter {param!r}: splitserve does not implement it",
                       param, "unsupported_parameter")
    if kind == "json_invalid":
        return invalid(f"malformed JSON body: {err.get('msg')}", None, "invalid_json")
    if kind == "missing":
        return invalid(f"missing required parameter {param!r}", param, "missing_required_parameter")
    where = f" for {param!r}" if param else ""
    return invalid(f"invalid value{where}: {err.get('msg')}", param, "invalid_value")


_GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


def from_grpc(exc) -> APIError:
    """A worker's refusal (grpc.aio.AioRpcError, or a session's WorkerCallError) as an APIError."""
    status, kind = _GRPC_TO_HTTP.get(exc.code(), (500, "server_error"))
    return APIError(status, exc.details() or exc.code().name, type=kind)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, str(exc.detail), type=kind).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}").body(), status_code=500)
