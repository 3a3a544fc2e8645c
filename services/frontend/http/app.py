"""The OpenAI-compatible HTTP API: chat and text completions, responses, models, tokenization,
health, metrics; and the operator's /admin/requests and /admin/migrate (live_moves.py).

The app is FastAPI with two pure-ASGI layers in front, outermost first: the
guard (guard.py: API keys, limits, body size, request timeout) and the
generation endpoints (http/generation.py: POST /v1/completions,
/v1/chat/completions, vLLM's /invocations (either, by the body's shape) and
/v1/responses (http/responses_api.py), served without
FastAPI's routing for the sake of latency). Everything else — /v1/models (503
until a worker can serve the model), /tokenize and /detokenize
(http/tokenization.py), /health, /ready, /metrics, /openapi.json, and the
OpenAI-style errors for unknown routes — is FastAPI.
"""

from __future__ import annotations

from typing import Literal

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from splitserve import __version__

from splitserve.services.frontend.errors import install_handlers, invalid
from splitserve.services.frontend.http.generation import GenerationEndpoints
from splitserve.services.frontend.guard import Guard, GuardMiddleware
from splitserve.services.frontend.core import Frontend
from splitserve.services.frontend.live_moves import METHOD_KV, METHOD_REPLAY
from splitserve.services.frontend.http.openapi import build_openapi
from splitserve.services.frontend.http.responses_api import ResponsesRoute
from splitserve.services.frontend.http.tokenization import install_tokenization


def build_app(frontend: Frontend, guard: Guard | None = None) -> GuardMiddleware:
    """The app; `guard` (keys, limits, rejected-requests counter) defaults to no keys and
    the default limits."""
    guard = guard or Guard()
    app = FastAPI(title="splitserve", docs_url=None, redoc_url=None, openapi_url=None)
    install_handlers(app)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if frontend.is_ready():
            return {"status": "ready", "model": frontend.model_name,
                    "all_workers_ready": frontend.pool.all_ready()}
        return JSONResponse({"status": "not ready"}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(frontend.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi():
        return _JSONResponse(build_openapi(frontend.model_name, __version__, frontend.tokenizer.vocab_size))

    @app.get("/v1/models")
    async def models():
        # Clients poll this to wait for a server and take the first model listed: until a
        # decode-capable worker is ready there is nothing to list, so 503 (as /ready), never
        # an empty list that looks like a server with no model.
        if (error := frontend.unavailable()) is not None:
            return _JSONResponse(error.body(), status_code=error.status)
        # vLLM's ModelCard: root and parent (no LoRA adapters here, so the model is its own root).
        return {"object": "list", "data": [{"id": frontend.model_name, "object": "model", "created": 0,
                                            "owned_by": "splitserve", "root": frontend.model_name, "parent": None,
                                            "max_model_len": frontend.max_model_len}]}

    @app.get("/admin/requests")
    async def admin_requests():
        return {"object": "list", "data": frontend.running_requests()}

    @app.post("/admin/migrate")
    async def admin_migrate(request: Request):
        try:
            body = MigrateRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            problem = exc.errors()[0]
            raise invalid(f"{'.'.join(map(str, problem['loc'])) or 'body'}: {problem['msg']}",
                          str(problem["loc"][0]) if problem["loc"] else None) from None
        result = await frontend.move(body.request_id, body.to, body.method == METHOD_REPLAY, body.timeout_s)
        return result.to_json()

    install_tokenization(app, frontend, _JSONResponse)
    endpoints = GenerationEndpoints(app, frontend, guard.limits.max_prompt_tokens)
    endpoints.routes["/v1/responses"] = ResponsesRoute(endpoints).prepare
    return GuardMiddleware(endpoints, guard)


class MigrateRequest(BaseModel):
    """POST /admin/migrate (`splitserve admin migrate`; services/frontend/live_moves.py)."""

    model_config = ConfigDict(extra="forbid")
    request_id: str                     # the response's id, as /admin/requests lists it
    to: str | None = None               # a decode worker's id; default: the router's pick, not the current one
    method: Literal["kv", "replay"] = METHOD_KV   # replay: recompute the context instead of moving the KV
    timeout_s: float = Field(60.0, gt=0)


class _JSONResponse(JSONResponse):
    """Starlette's JSONResponse encoded by orjson: the same compact UTF-8 bytes for these
    bodies, several times faster (a NaN or infinity becomes null instead of an error)."""

    def render(self, content) -> bytes:
        return orjson.dumps(content)
