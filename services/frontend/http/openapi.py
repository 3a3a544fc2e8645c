"""The HTTP API's OpenAPI 3.1 document, built from the request models the app really parses.

The app parses bodies by hand (generation_http.parse_body) to phrase every failure
as an OpenAI error, so FastAPI cannot infer the request schemas; this module
writes them from the same pydantic models (protocol.py), with every refusal the
app can answer (400, 401, 404, 413, 429, 503, 504) described by one error schema.
`model` is an enum of the one served name once the workers have reported it:
any other name is a 404, so a schema-driven fuzzer reaches the workers instead
of stopping at the model check. Parameters accepted at one value only (n,
best_of, echo, penalties, logit_bias), positive token counts, one prompt per
request and token ids inside the vocabulary are described as such. Served at /openapi.json (open, like /health).
"""

from __future__ import annotations

from pydantic.json_schema import models_json_schema

from splitserve.services.frontend.http.protocol import ChatCompletionRequest, CompletionRequest

REF = "#/components/schemas/{model}"

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}

# One server-sent event (OpenAPI before 3.2: `schema` describes each event of the stream).
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string", "description": "one JSON chunk, or [DONE] at the end"},
                            "event": {"type": "string"}}}

_REFUSALS = {
    "400": "invalid request (malformed JSON, schema violation, unsupported value, prompt too long)",
    "401": "missing or unknown API key (only when keys are configured)",
    "404": "unknown model or route",
    "413": "request body larger than --max-body-bytes",
    "429": "per-client concurrency or rate limit (Retry-After says when to retry)",
    "503": "no worker is ready",
    "504": "the request timed out (--request-timeout)",
}


def _errors(codes) -> dict:
    return {code: {"description": _REFUSALS[code],
                   "content": {"application/json": {"schema": {"$ref": REF.format(model="Error")}}}}
            for code in codes}


def _generation(name: str, summary: str) -> dict:
    return {"post": {
        "summary": summary,
        "operationId": name,
        "security": [{}, {"bearer": []}],
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": REF.format(model=name)}}}},
        "responses": {
            "200": {"description": "the completion (JSON), or server-sent events with stream=true",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": SSE_EVENT}}},
            **_errors(_REFUSALS),
        },
    }}


def _open_get(summary: str, media: str = "application/json", statuses=("200",)) -> dict:
    responses = {code: {"description": summary, "content": {media: {"schema": {
        "type": "object" if media == "application/json" else "string"}}}} for code in statuses}
    return {"get": {"summary": summary, "security": [{}], "responses": responses}}


_NULL = {"type": "null"}
# Fields the models accept by type but the app takes at one value only (protocol.unsupported_values),
# and counts that must be positive (lifecycle.sampling_params).
_ONLY = {
    "n": {"anyOf": [{"const": 1}, _NULL]},
    "best_of": {"anyOf": [{"const": 1}, _NULL]},
    "echo": {"type": "boolean", "const": False},
    "suffix": {"anyOf": [{"const": ""}, _NULL]},
    "presence_penalty": {"anyOf": [{"const": 0}, _NULL]},
    "frequency_penalty": {"anyOf": [{"const": 0}, _NULL]},
    "logit_bias": {"anyOf": [{"type": "object", "maxProperties": 0}, _NULL]},
    "max_tokens": {"anyOf": [{"type": "integer", "minimum": 1}, _NULL]},
    "max_completion_tokens": {"anyOf": [{"type": "integer", "minimum": 1}, _NULL]},
}


def _narrow(props: dict, vocab_size: int | None) -> None:
    """Describe what the app accepts beyond the models' types (see _ONLY), in place."""
    for name, schema in _ONLY.items():
        if name in props:
            props[name] = {**schema, "title": props[name].get("title", name)}
    prompt = props.get("prompt")
    if prompt is None:
        return
    for variant in prompt["anyOf"]:
        items = variant.get("items", {})
        for text in (variant, items):
            if text.get("type") == "string":
                text["minLength"] = 1                 # an empty prompt is refused
        if items.get("type") in ("string", "array"):
            variant["minItems"] = variant["maxItems"] = 1     # one prompt per request, never none
        for ids in (items, items.get("items", {})):
            if ids.get("type") == "integer" and vocab_size:
                ids["maximum"] = vocab_size - 1       # the tokenizer's vocabulary


def build_openapi(model_name: str | None, version: str, vocab_size: int | None = None) -> dict:
    _, defs = models_json_schema([(ChatCompletionRequest, "validation"), (CompletionRequest, "validation")],
                                 ref_template=REF)
    schemas = {**defs["$defs"], "Error": ERROR_SCHEMA}
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        _narrow(schemas[name]["properties"], vocab_size)
        if model_name is not None:
            schemas[name]["properties"]["model"] = {"type": "string", "enum": [model_name],
                                                    "title": "Model"}
    models = _open_get("the served model", statuses=("200",))
    models["get"]["security"] = [{}, {"bearer": []}]
    models["get"]["responses"].update(_errors(("401", "503")))
    return {
        "openapi": "3.1.0",
        "info": {"title": "splitserve", "version": version,
                 "description": "OpenAI-compatible API. Every refusal is {\"error\": {message, type, param, code}}."},
        "paths": {
            "/v1/chat/completions": _generation("ChatCompletionRequest", "Create a chat completion"),
            "/v1/completions": _generation("CompletionRequest", "Create a text completion"),
            "/v1/models": models,
            "/health": _open_get("the process is up"),
            "/ready": _open_get("a decode-capable worker is ready (503 until then)", statuses=("200", "503")),
            "/metrics": _open_get("Prometheus metrics", media="text/plain"),
        },
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "an API key from --api-key"}}},
    }
