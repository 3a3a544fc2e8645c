"""The OpenAI-compatible HTTP API (FastAPI): chat and text completions, models, health.

Bodies are parsed by hand (json, then the pydantic model) so that every
failure, malformed JSON included, becomes an OpenAI-style 4xx. A request is
"primed" before any byte of the response is sent: the worker's first message
(or its refusal) arrives first, so a streamed request that the worker rejects
still gets a proper 4xx instead of a 200 that breaks off. While priming, and
for the whole of a non-streamed request, a watcher cancels the work when the
client disconnects; during streaming Starlette does that itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from splitserve import __version__

from . import metrics as m
from .errors import APIError, from_validation_error, install_handlers, invalid
from .guard import Guard, GuardMiddleware
from .lifecycle import Delta, Frontend, GenerationRequest, SamplingRequest, new_request_id
from .limits import PromptBound, check_prompt_tokens
from .openapi import build_openapi
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses import ChatFormatter, CompletionFormatter

log = logging.getLogger(__name__)

T = TypeVar("T")
ModelT = TypeVar("ModelT", bound=BaseModel)


async def parse_body(request: Request, model: type[ModelT]) -> ModelT:
    raw = await request.body()
    try:
        data = loads_body(raw)
    except ValueError as exc:
        raise invalid(f"malformed JSON body: {str(exc)[:200]}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_json")
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    for param, message in body.unsupported_values():
        raise invalid(message, param, "unsupported_parameter")
    return body


def loads_body(raw: bytes):
    """Parse a JSON body; ValueError for anything that is not JSON or holds text no tokenizer takes.

    orjson first: it refuses invalid UTF-8, lone surrogates and nesting beyond 1024 levels
    outright. What it refuses but Python's json reads — NaN, Infinity, integers beyond 64
    bits — is parsed again so that the schema check names the offending field (a NaN
    temperature is an invalid temperature), as long as no string holds a lone surrogate.
    """
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as strict_error:
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            raise strict_error from None
    pending = [data]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, str):
            item.encode("utf-8")          # UnicodeEncodeError (a ValueError) on a lone surrogate
    return data


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; cancel it (and raise CancelledError) if the client disconnects first,
    or if this handler itself is cancelled (the request timeout, shutdown)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()               # otherwise the work (and its worker call) would run on, orphaned
        await asyncio.gather(task, return_exceptions=True)
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise asyncio.CancelledError("client disconnected")
    return task.result()


def build_app(frontend: Frontend, guard: Guard | None = None) -> FastAPI:
    """The app; `guard` (keys, limits, rejected-requests counter) wraps it when given."""
    app = FastAPI(title="splitserve", docs_url=None, redoc_url=None, openapi_url=None)
    install_handlers(app)
    if guard is not None:
        app.add_middleware(GuardMiddleware, guard=guard)
    max_prompt_tokens = guard.limits.max_prompt_tokens if guard is not None else 0
    bound = PromptBound.of(frontend.tokenizer)

    def check_length(api: str, num_chars: int, param: str) -> None:
        """Before tokenizing: a text that cannot fit is refused without spending CPU on it."""
        _refusing(frontend, api, lambda: bound.check(num_chars, max_prompt_tokens or frontend.max_model_len, param))

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
        name = frontend.model_name
        data = [] if name is None else [{"id": name, "object": "model", "created": 0,
                                         "owned_by": "splitserve", "max_model_len": frontend.max_model_len}]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse(frontend, request, ChatCompletionRequest, "chat")
        messages = [{"role": "system" if msg.role == "developer" else msg.role, "content": msg.text()}
                    for msg in body.messages]
        check_length("chat", sum(len(msg["content"]) for msg in messages), "messages")
        prompt_ids = _refusing(frontend, "chat", lambda: frontend.chat_prompt(messages))
        sampling = SamplingRequest(
            max_tokens=body.requested_max_tokens(), default_max_tokens=None,
            max_tokens_param="max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
            logprobs=body.num_logprobs(), **_sampling_fields(body))
        _refusing(frontend, "chat", lambda: check_prompt_tokens(len(prompt_ids), max_prompt_tokens, "messages"))
        gen = _prepare(frontend, "chat", "chatcmpl", prompt_ids, sampling)
        fmt = ChatFormatter(gen.request_id, frontend.model_name, frontend.tokenizer, body)
        return await _respond(request, frontend, gen, fmt, body.stream)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(frontend, request, CompletionRequest, "completions")
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            check_length("completions", len(prompt), "prompt")
        prompt_ids = _refusing(frontend, "completions", lambda: frontend.text_prompt(prompt))
        sampling = SamplingRequest(max_tokens=body.max_tokens, default_max_tokens=16,
                                   logprobs=body.logprobs, **_sampling_fields(body))
        _refusing(frontend, "completions", lambda: check_prompt_tokens(len(prompt_ids), max_prompt_tokens, "prompt"))
        gen = _prepare(frontend, "completions", "cmpl", prompt_ids, sampling)
        fmt = CompletionFormatter(gen.request_id, frontend.model_name, frontend.tokenizer, body)
        return await _respond(request, frontend, gen, fmt, body.stream)

    return app


def _sampling_fields(body) -> dict:
    return dict(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                seed=body.seed, stop=body.stop_list(), ignore_eos=body.ignore_eos)


async def _parse(frontend: Frontend, request: Request, model: type[ModelT], api: str) -> ModelT:
    try:
        body = await parse_body(request, model)
        frontend.check_model(body.model)
        return body
    except APIError as exc:
        frontend.metrics.requests.labels(api, m.STATUS_INVALID if exc.status < 500 else m.STATUS_UNAVAILABLE).inc()
        raise


def _refusing(frontend: Frontend, api: str, fn):
    try:
        return fn()
    except APIError as exc:
        frontend.metrics.requests.labels(api, m.STATUS_INVALID if exc.status < 500 else m.STATUS_UNAVAILABLE).inc()
        raise


def _prepare(frontend: Frontend, api: str, prefix: str, prompt_ids: list[int],
             sampling: SamplingRequest) -> GenerationRequest:
    params = _refusing(frontend, api, lambda: frontend.sampling_params(sampling, len(prompt_ids)))
    return GenerationRequest(new_request_id(prefix), api, prompt_ids, params)


async def _respond(request: Request, frontend: Frontend, gen: GenerationRequest, fmt, stream: bool):
    deltas = frontend.generate(gen)
    try:
        first = await unless_disconnected(request, anext(deltas))
    except (APIError, asyncio.CancelledError):
        await deltas.aclose()
        raise
    if stream:
        return StreamingResponse(_sse(fmt, first, deltas), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": gen.request_id})
    return _JSONResponse(await unless_disconnected(request, _collect(fmt, first, deltas)),
                         headers={"X-Request-Id": gen.request_id})


async def _collect(fmt, first: Delta, deltas: AsyncIterator[Delta]) -> dict:
    collected = [first]
    try:
        if first.finish_reason is None:
            async for delta in deltas:
                collected.append(delta)
    finally:
        await deltas.aclose()
    return fmt.full(collected)


async def _sse(fmt, first: Delta, deltas: AsyncIterator[Delta]) -> AsyncIterator[bytes]:
    # One write per worker message: its events go out together, and the last one also
    # carries the usage chunk and [DONE], so the end of a stream is one send, not three.
    pending = b""
    try:
        pending = b"".join(_event(chunk) for chunk in fmt.opening())
        delta = first
        while True:
            pending += b"".join(_event(chunk) for chunk in fmt.chunks(delta))
            if delta.finish_reason is not None:
                break
            if pending:
                yield pending
                pending = b""
            delta = await anext(deltas)
        pending += b"".join(_event(chunk) for chunk in fmt.closing())
    except APIError as exc:
        # Headers are gone already: report in-band, as OpenAI does, and end the stream.
        pending += _event(exc.body())
    except StopAsyncIteration:
        pending += _event(APIError(502, "the worker ended the stream early", type="server_error").body())
    finally:
        await deltas.aclose()
    yield pending + b"data: [DONE]\n\n"


def _event(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class _JSONResponse(JSONResponse):
    """Starlette's JSONResponse encoded by orjson: the same compact UTF-8 bytes for these
    bodies, several times faster (a NaN or infinity becomes null instead of an error)."""

    def render(self, content) -> bytes:
        return orjson.dumps(content)
