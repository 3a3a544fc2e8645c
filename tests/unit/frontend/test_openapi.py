"""The OpenAPI document: valid for schemathesis, and describing the models the app parses."""

from __future__ import annotations

import schemathesis

from splitserve.services.frontend.http.openapi import build_openapi
from splitserve.services.frontend.http.protocol import ChatCompletionRequest, CompletionRequest
from splitserve.services.frontend.http.responses_api import ResponsesRequest
from splitserve.services.frontend.http.tokenization import DetokenizeRequest, TokenizeChatRequest


def test_document_loads_and_lists_every_operation():
    doc = build_openapi("served", "0.1.0")
    schema = schemathesis.openapi.from_dict(doc)
    labels = {op.ok().label for op in schema.get_all_operations()}
    assert labels == {"POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "POST /invocations",
                      "GET /v1/models",
                      "POST /tokenize", "POST /detokenize", "GET /health", "GET /ready", "GET /metrics"}


def test_request_schemas_are_the_pydantic_models():
    schemas = build_openapi("served", "0.1.0")["components"]["schemas"]
    for model in (ChatCompletionRequest, CompletionRequest):
        props = schemas[model.__name__]["properties"]
        assert set(props) == set(model.model_fields)
        assert props["model"]["enum"] == ["served"]
        assert schemas[model.__name__]["additionalProperties"] is False
    assert "enum" not in build_openapi(None, "0")["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
    for model in (ResponsesRequest, TokenizeChatRequest, DetokenizeRequest):
        assert set(schemas[model.__name__]["properties"]) == set(model.model_fields)
    assert schemas["ResponsesRequest"]["properties"]["model"]["enum"] == ["served"]
    assert schemas["DetokenizeRequest"]["properties"]["model"]["anyOf"][1] == {"type": "null"}   # optional


def test_tokenize_takes_either_of_vllms_bodies():
    body = build_openapi("m", "0")["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]
    assert [ref["$ref"].rsplit("/", 1)[1] for ref in body["schema"]["oneOf"]] == [
        "TokenizeCompletionRequest", "TokenizeChatRequest"]


def test_every_refusal_is_documented_with_the_error_schema():
    op = build_openapi("m", "0")["paths"]["/v1/completions"]["post"]
    for status in ("400", "401", "404", "413", "429", "503", "504"):
        ref = op["responses"][status]["content"]["application/json"]["schema"]["$ref"]
        assert ref == "#/components/schemas/Error"


def test_models_documents_its_503_before_a_worker_is_ready():
    responses = build_openapi("m", "0")["paths"]["/v1/models"]["get"]["responses"]
    assert set(responses) == {"200", "401", "503"}
