"""A test that cannot find what it needs fails in CI; it never skips there.

Every `pytest.skip(...)` in the suite and its support code sits in a function that also fails
when `CI == "true"` (where `make test` installs everything, a skip would hide a broken install);
`pytest.importorskip` and skip markers, which cannot, are not used at all.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("tests", "splitserve/testing", "bench")


def _sources() -> list[Path]:
    return sorted(p for folder in SCANNED for p in (ROOT / folder).rglob("*.py"))


def _calls(node: ast.AST, attribute: str) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == attribute and isinstance(n.func.value, ast.Name) and n.func.value.id == "pytest"]


def _checks_ci(function: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and n.value == "CI" for n in ast.walk(function)) \
        and bool(_calls(function, "fail"))


def test_every_skip_fails_instead_under_ci():
    unguarded, scanned = [], 0
    for path in _sources():
        if path == Path(__file__):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            skips = [c for c in _calls(function, "skip")
                     if not any(c in _calls(inner, "skip") for inner in ast.walk(function)
                                if inner is not function and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)))]
            scanned += len(skips)
            if skips and not _checks_ci(function):
                unguarded.append(f"{path.relative_to(ROOT)}:{function.lineno} {function.name}")
    assert scanned >= 3, "the scan found none of the suite's known skips: it is not looking"
    assert not unguarded, f"skips that would hide a missing dependency in CI: {unguarded}"


def test_no_importorskip_or_skip_markers():
    found = []
    for path in _sources():
        if path == Path(__file__):
            continue
        text = path.read_text(encoding="utf-8")
        for needle in ("importorskip", "mark.skip", "mark.xfail"):
            if needle in text:
                found.append(f"{path.relative_to(ROOT)}: {needle}")
    assert not found, found
