"""Hypothesis strategies for JSON schemas whose every instance is short.

Structured-output tests generate with random-weight models, which never choose to
end a string or stop an array on their own: under a grammar, only the schema's
bounds end them. So every string has a maxLength, every array a maxItems, every
number a range, and nesting stops at depth 2; objects close their properties
(additionalProperties false), as OpenAI's strict mode requires.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

_NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
_WORDS = st.text(alphabet="abcdefghijklmnopqrstuvwxyz ", min_size=1, max_size=6)


def _integer() -> st.SearchStrategy[dict[str, Any]]:
    return st.integers(-1000, 1000).flatmap(
        lambda low: st.integers(low, low + 500).map(lambda high: {"type": "integer", "minimum": low, "maximum": high}))


_LEAVES = st.one_of(
    _integer(),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(_WORDS, min_size=1, max_size=4, unique=True).map(lambda words: {"enum": words}),
    st.lists(st.integers(-50, 50), min_size=1, max_size=3, unique=True).map(lambda ints: {"enum": ints}),
)


def _array(items: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.tuples(items, st.integers(0, 1), st.integers(1, 3)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": max(t[1], t[2])})


def _object(values: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    def build(props: dict[str, dict], required_mask: list[bool]) -> dict[str, Any]:
        names = sorted(props)
        required = [n for n, keep in zip(names, required_mask) if keep]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

    return st.dictionaries(_NAMES, values, min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.booleans(), min_size=len(props), max_size=len(props)).map(
            lambda mask: build(props, mask)))


def bounded_schemas() -> st.SearchStrategy[dict[str, Any]]:
    """Object schemas (OpenAI's response_format wants an object at the top), depth <= 2."""
    inner = st.one_of(_LEAVES, _array(_LEAVES))
    return _object(st.one_of(inner, _object(inner), _array(_object(_LEAVES))))


def draw_schemas(n: int) -> list[dict[str, Any]]:
    """`n` schemas of `bounded_schemas`, the same ones on every run (for tests that send them
    all at once, which `@given`'s one-example-at-a-time cannot)."""
    from hypothesis import given, settings

    drawn: list[dict[str, Any]] = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None)
    @given(bounded_schemas())
    def collect(schema: dict[str, Any]) -> None:
        drawn.append(schema)

    collect()
    return drawn[:n]
