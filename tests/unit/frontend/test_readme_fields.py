"""The README's table of OpenAI request fields names exactly the fields the frontend's schema
takes: a field added to the schema without a row (or a row for a field that is gone) fails."""

from __future__ import annotations

import re
from pathlib import Path

from splitserve.services.frontend.http.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions

README = Path(__file__).resolve().parents[3] / "README.md"


def _table_fields() -> set[str]:
    text = README.read_text()
    section = text[text.index("## OpenAI API: the request fields"):]
    section = section[:section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    names: set[str] = set()
    for row in rows:
        first_cell = row.split("|")[1]
        names |= set(re.findall(r"`([a-z_*]+)(?:[:` ])", first_cell + " "))
    return names


def test_the_readme_table_names_every_request_field():
    schema = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    table = _table_fields()
    guided = {f for f in schema if f.startswith("guided_")}
    assert "guided_*" in table and guided
    table = (table - {"guided_*"}) | guided
    assert schema - table == set(), f"fields without a README row: {sorted(schema - table)}"
    assert table - schema == set(), f"README rows for no field: {sorted(table - schema)}"
    assert set(StreamOptions.model_fields) == {"include_usage", "continuous_usage_stats"}
