"""Schema-driven fuzzing (schemathesis) of the HTTP API against real processes.

The schema is the frontend's own /openapi.json, which describes the request
models the app parses (services/frontend/http/openapi.py). Positive cases (valid by
the schema) must be served or refused with a 4xx; negative cases (schema
violations) must be refused with a 4xx; never a 5xx, and every refusal is an
OpenAI-style error. schemathesis' own checks run too: no server error, status
codes and content types as documented, error bodies matching the schema.
(schemathesis also sends integral floats such as 5.0 for integer fields, which
JSON Schema calls integers; the strict request models refuse them with a 400
naming the field, which is a refusal like any other here.)

Generation is deterministic (derandomize) and bounded: EXAMPLES cases per
operation and mode. max_tokens is capped before sending so that valid requests
finish quickly on the 2-core CI machines; the count of each status is printed.
"""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from .conftest import AUTH, Tally, assert_openai_error

EXAMPLES = 40
MAX_TOKENS_CAP = 4
P, N = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
# (path, method, mode); GET /v1/models takes no input, so it has no negative cases.
CASES = [("/v1/chat/completions", "POST", P), ("/v1/chat/completions", "POST", N),
         ("/v1/completions", "POST", P), ("/v1/completions", "POST", N), ("/v1/models", "GET", P),
         ("/v1/responses", "POST", P), ("/v1/responses", "POST", N), ("/tokenize", "POST", P),
         ("/tokenize", "POST", N), ("/detokenize", "POST", P), ("/detokenize", "POST", N)]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def _cap(case) -> None:
    """Keep generation short: valid requests would otherwise ask for up to the whole context."""
    body = case.body
    if isinstance(body, dict):
        if case.path == "/v1/chat/completions" and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = MAX_TOKENS_CAP      # a chat request's default is the rest of the context
        if "input" in body and body.get("max_output_tokens") is None:
            body["max_output_tokens"] = MAX_TOKENS_CAP    # so is a response's
        for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if isinstance(body.get(name), int) and not isinstance(body.get(name), bool) and body[name] > MAX_TOKENS_CAP:
                body[name] = MAX_TOKENS_CAP


@pytest.mark.parametrize("path,method,mode", CASES, ids=lambda x: str(x))
def test_schema_fuzz(front, path, method, mode):
    schema = schemathesis.openapi.from_url(f"{front.base_url}/openapi.json")
    operation = schema[path][method]
    tally = Tally()

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        _cap(case)
        headers = {**AUTH, **{k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}}
        response = case.call(base_url=front.base_url, headers=headers, timeout=60)
        tally.add(response.status_code, response.content)
        case.validate_response(response, checks=CHECKS)
        if response.status_code >= 400:
            assert_openai_error(response.status_code, response.content)
        elif mode is GenerationMode.NEGATIVE and method == "POST":
            # schemathesis' negative cases may still be valid JSON bodies the app accepts
            # (e.g. a wrong Content-Type header with a valid body); they must then be served.
            assert response.status_code == 200

    run()
    print(tally.summary(f"{method} {path} {mode}"))
    if os.environ.get("SPLITSERVE_FUZZ_VERBOSE"):      # what the refusals said, for tuning the schema
        print("\n".join(sorted({m[:150] for m in tally.messages})))
    assert tally.num_cases > 0 and tally.num_5xx == 0
