"""The HTTP API's OpenAPI 3.1 document, built from the request models the app really parses.

The app parses bodies by hand (generation_http.parse_body) to phrase every failure
as an OpenAI error, so FastAPI cannot infer the request schemas; this module
writes them from the same pydantic models (protocol.py), with every refusal the
app can answer (400, 401, 404, 413, 429, 503, 504) described by one error schema.
`model` is an enum of the one served name once the workers have reported it:
any other name is a 404, so a schema-driven fuzzer reaches the workers instead
of stopping at the model check. Parameters accepted at one value only (n,
best_of, echo, penalties, logit_bias), positive token counts, one prompt per
request and token ids inside the vocabulary are described as such; so are the
values /v1/responses takes for "plain text, nothing kept" (store, background,
tools...). /tokenize's body is either of vLLM's two shapes (oneOf), and its
`model` is optional. Served at /openapi.json (open, like /health).
"""

from __future__ import annotations

from pydantic.json_schema import models_json_schema

from splitserve.services.frontend.http.protocol import ChatCompletionRequest, CompletionRequest
from splitserve.services.frontend.http.responses_api import TEXT_PARTS, ResponsesRequest
from splitserve.services.frontend.http.tokenization import (DetokenizeRequest, TokenizeChatRequest,
                                                             TokenizeCompletionRequest)

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
    "429": "per-client concurrency or rate limit, or shed by flow control (--flow-control: the reason in "
           "x-llm-d-request-dropped-reason); Retry-After says when to retry",
    "503": "no worker is ready",
    "504": "the request timed out (--request-timeout)",
}


def _errors(codes) -> dict:
    return {code: {"description": _REFUSALS[code],
                   "content": {"application/json": {"schema": {"$ref": REF.format(model="Error")}}}}
            for code in codes}


def _generation(name: str, summary: str, schema: dict | None = None) -> dict:
    return {"post": {
        "summary": summary,
        "operationId": name,
        "security": [{}, {"bearer": []}],
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": schema or {"$ref": REF.format(model=name)}}}},
        "responses": {
            "200": {"description": "the completion (JSON), or server-sent events with stream=true",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": SSE_EVENT}}},
            **_errors(_REFUSALS),
        },
    }}


def _tokenization(name: str, summary: str, request: dict, response: dict) -> dict:
    return {"post": {
        "summary": summary,
        "operationId": name,
        "security": [{}, {"bearer": []}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {"200": {"description": summary, "content": {"application/json": {"schema": response}}},
                      **_errors(_REFUSALS)},
    }}


_TOKENIZE_RESPONSE = {"type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
    "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
    "tokens": {"type": "array", "items": {"type": "integer"}},
    "token_strs": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]}}}
_DETOKENIZE_RESPONSE = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}


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
# /v1/responses only (responses_api.unsupported_values): the values that mean "plain text, nothing kept".
_ONLY_RESPONSES = {
    "max_output_tokens": {"anyOf": [{"type": "integer", "minimum": 1}, _NULL]},
    "store": {"anyOf": [{"const": False}, _NULL]},
    "background": {"anyOf": [{"const": False}, _NULL]},
    "previous_response_id": _NULL,
    "tools": {"anyOf": [{"type": "array", "maxItems": 0}, _NULL]},
    "tool_choice": {"anyOf": [{"enum": ["none", "auto"]}, _NULL]},
    "reasoning": _NULL,
    "truncation": {"anyOf": [{"const": "disabled"}, _NULL]},
    "include": {"anyOf": [{"type": "array", "maxItems": 0}, _NULL]},
}


def _narrow(props: dict, vocab_size: int | None, only: dict = _ONLY) -> None:
    """Describe what the app accepts beyond the models' types (see _ONLY), in place."""
    for name, schema in only.items():
        if name in props:
            props[name] = {**schema, "title": props[name].get("title", name)}
    prompt = props.get("prompt")
    if prompt is None or "anyOf" not in prompt:       # /tokenize's prompt is any string
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


def _narrow_ids(ids: dict, vocab_size: int | None) -> None:
    if vocab_size and ids.get("items", {}).get("type") == "integer":
        ids["items"]["maximum"] = vocab_size - 1


def build_openapi(model_name: str | None, version: str, vocab_size: int | None = None) -> dict:
    models_parsed = (ChatCompletionRequest, CompletionRequest, ResponsesRequest, TokenizeCompletionRequest,
                     TokenizeChatRequest, DetokenizeRequest)
    _, defs = models_json_schema([(model, "validation") for model in models_parsed], ref_template=REF)
    schemas = {**defs["$defs"], "Error": ERROR_SCHEMA}
    for name in (model.__name__ for model in models_parsed):
        _narrow(schemas[name]["properties"], vocab_size,
                {**_ONLY, **_ONLY_RESPONSES} if name == "ResponsesRequest" else _ONLY)
        if model_name is not None:
            served = {"type": "string", "enum": [model_name], "title": "Model"}
            # Tokenization takes the model as optional, as vLLM does.
            optional = "model" not in schemas[name].get("required", ())
            schemas[name]["properties"]["model"] = {"anyOf": [served, _NULL]} if optional else served
    _narrow_ids(schemas["DetokenizeRequest"]["properties"]["tokens"], vocab_size)
    # Parts of any other type are read only to be refused by name (responses_api.ContentPart).
    part = schemas["ContentPart"]
    part["properties"]["type"] = {"enum": list(TEXT_PARTS), "title": "Type"}
    part["properties"]["text"] = {"type": "string", "title": "Text"}
    part["required"] = ["type", "text"]
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
            "/v1/responses": _generation("ResponsesRequest", "Create a response (text in, text out)"),
            "/invocations": _generation("Invocations", "vLLM's SageMaker route: a chat completion (`messages`) "
                                        "or a text completion (`prompt`), by the body's shape",
                                        {"oneOf": [{"$ref": REF.format(model="ChatCompletionRequest")},
                                                   {"$ref": REF.format(model="CompletionRequest")}]}),
            "/v1/models": models,
            "/tokenize": _tokenization(
                "Tokenize", "Tokenize a text or a chat (vLLM's schema)",
                {"oneOf": [{"$ref": REF.format(model="TokenizeCompletionRequest")},
                           {"$ref": REF.format(model="TokenizeChatRequest")}]}, _TOKENIZE_RESPONSE),
            "/detokenize": _tokenization("Detokenize", "Token ids back to text (vLLM's schema)",
                                         {"$ref": REF.format(model="DetokenizeRequest")}, _DETOKENIZE_RESPONSE),
            "/health": _open_get("the process is up"),
            "/ready": _open_get("a decode-capable worker is ready (503 until then)", statuses=("200", "503")),
            "/metrics": _open_get("Prometheus metrics", media="text/plain"),
        },
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "an API key from --api-key"}}},
    }
