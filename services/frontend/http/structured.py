"""Structured outputs as a request asks for them: one StructuredOutput, or a 400.

Clients ask in three dialects, all accepted: OpenAI's `response_format`
(`json_object`, `json_schema` — with or without `strict`: the schema is enforced
either way — and vLLM's `structural_tag`), vLLM's older `guided_json` /
`guided_regex` / `guided_choice` / `guided_grammar` / `structural_tag`, and its
newer `structured_outputs` object. A request may ask for one structure only.

Only the shape is checked here; the grammar itself is compiled by the worker
(services/engine/grammar.py), which answers a bad schema, regex or grammar with
INVALID_ARGUMENT — a 400 naming what is wrong — before any prefill runs. The
frontend never imports xgrammar (it would bring torch into the frontend process).
"""

from __future__ import annotations

import json
from typing import Any

from splitserve.services.frontend.errors import invalid
from splitserve.services.worker_protocol.sampling_params import StructuredOutput

BACKENDS = (None, "auto", "xgrammar")
# structured_outputs' options that change nothing here: no fallback backend exists, JSON is
# always compact, and a schema's additionalProperties is enforced as written.
_INERT_OPTIONS = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties"}
_STRUCTURED_OUTPUTS_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                             "json_object": "json_object", "structural_tag": "structural_tag"}


def requested_structure(body) -> StructuredOutput | None:
    """The request's structured output (None: free text); raises APIError for a malformed ask."""
    asked: list[tuple[str, StructuredOutput]] = []
    if body.response_format is not None:
        spec = _from_response_format(body.response_format)
        if spec is not None:
            asked.append(("response_format", spec))
    if body.guided_json is not None:
        asked.append(("guided_json", StructuredOutput("json_schema", _schema_text(body.guided_json, "guided_json"))))
    if body.guided_regex is not None:
        asked.append(("guided_regex", StructuredOutput("regex", body.guided_regex)))
    if body.guided_choice is not None:
        asked.append(("guided_choice", StructuredOutput("choice", json.dumps(body.guided_choice))))
    if body.guided_grammar is not None:
        asked.append(("guided_grammar", StructuredOutput("grammar", body.guided_grammar)))
    if body.structural_tag is not None:
        asked.append(("structural_tag", StructuredOutput("structural_tag", body.structural_tag)))
    if body.structured_outputs is not None:
        asked += _from_structured_outputs(body.structured_outputs)
    if body.guided_decoding_backend not in BACKENDS:
        raise invalid(f"guided_decoding_backend {body.guided_decoding_backend!r} is not available: this server's "
                      "structured outputs use xgrammar ('xgrammar' or 'auto')", "guided_decoding_backend")
    if body.guided_whitespace_pattern is not None:
        raise invalid("guided_whitespace_pattern is not supported: xgrammar takes no whitespace pattern "
                      "(JSON is generated compact)", "guided_whitespace_pattern")
    if len(asked) > 1:
        raise invalid(f"only one structured output per request; this one asks for {len(asked)} "
                      f"({', '.join(name for name, _ in asked)})", asked[1][0])
    return asked[0][1] if asked else None


def _from_response_format(fmt: dict[str, Any]) -> StructuredOutput | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", "")
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict):
            raise invalid("response_format json_schema needs a json_schema object "
                          '({"name": ..., "schema": {...}, "strict": true})', "response_format")
        schema = inner.get("schema", inner.get("json_schema"))   # "json_schema": vLLM's older alias
        if schema is None:
            return StructuredOutput("json_object", "")            # OpenAI: the schema is optional
        return StructuredOutput("json_schema", _schema_text(schema, "response_format"))
    if kind == "structural_tag":
        tag = {k: v for k, v in fmt.items() if k != "type"}
        if "format" in tag:
            tag = {"type": "structural_tag", **tag}
        return StructuredOutput("structural_tag", json.dumps(tag))
    raise invalid(f"response_format type must be text, json_object, json_schema or structural_tag, got {kind!r}",
                  "response_format")


def _from_structured_outputs(options: dict[str, Any]) -> list[tuple[str, StructuredOutput]]:
    unknown = set(options) - set(_STRUCTURED_OUTPUTS_KINDS) - _INERT_OPTIONS - {"whitespace_pattern"}
    if unknown:
        raise invalid(f"structured_outputs has unknown keys {sorted(unknown)}; it takes "
                      f"{', '.join(sorted(_STRUCTURED_OUTPUTS_KINDS))}", "structured_outputs")
    if options.get("whitespace_pattern") is not None:
        raise invalid("structured_outputs.whitespace_pattern is not supported: xgrammar takes no whitespace "
                      "pattern (JSON is generated compact)", "structured_outputs")
    asked = []
    for key, kind in _STRUCTURED_OUTPUTS_KINDS.items():
        value = options.get(key)
        if value is None or value is False:
            continue
        if key == "json":
            spec = _schema_text(value, "structured_outputs")
        elif key == "json_object":
            spec = ""
        elif key == "choice":
            spec = json.dumps(value)
        elif isinstance(value, str):
            spec = value
        elif key == "structural_tag" and isinstance(value, dict):
            spec = json.dumps(value)
        else:
            raise invalid(f"structured_outputs.{key} must be a string", "structured_outputs")
        asked.append(("structured_outputs", StructuredOutput(kind, spec)))
    return asked


def _schema_text(schema: Any, param: str) -> str:
    """A JSON schema given as an object or as its JSON text, as text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise invalid(f"{param}: the JSON schema is not valid JSON ({exc})", param) from exc
    if not isinstance(schema, (dict, bool)):
        raise invalid(f"{param}: a JSON schema must be an object", param)
    return json.dumps(schema)

