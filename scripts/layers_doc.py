"""docs/architecture.md's layer table, generated from the import contracts of pyproject.toml.

The table sits between two marker lines in §1; `--write` rewrites it there, and the suite
(tests/unit/test_architecture.py) fails while the doc's table differs from the contracts.

    python scripts/layers_doc.py --write
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
BEGIN = "<!-- layers: generated from pyproject.toml [tool.importlinter] by scripts/layers_doc.py -->"
END = "<!-- /layers -->"


def contracts() -> list[dict]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def folder_of(module: str) -> str:
    """`splitserve.services.worker` → `services/worker/` (pyproject's package-dir mapping)."""
    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    prefix = max((p for p in mapping if module == p or module.startswith(p + ".")), key=len)
    rest = module[len(prefix):].lstrip(".").replace(".", "/")
    base = mapping[prefix]
    if not rest:
        return f"{base}/"
    path = f"{base}/{rest}"
    return f"{path}/" if (REPO / path).is_dir() else f"{path}.py"


def table() -> str:
    """Markdown: one row per layer, top first, then the other contracts in words."""
    rows = ["| layer (imports only the rows below it) | packages |", "|---|---|"]
    layers = next(c for c in contracts() if c["type"] == "layers")["layers"]
    for number, layer in enumerate(layers, 1):
        independent = "|" in layer
        names = [n.strip() for n in re.split(r"[|:]", layer)]
        joined = (" · " if independent else ", ").join(f"`{folder_of(n)}`" for n in names)
        note = " (independent of each other)" if independent and len(names) > 1 else ""
        rows.append(f"| {len(layers) - number + 1} | {joined}{note} |")
    lines = ["\n".join(rows), ""]
    for c in contracts():
        if c["type"] == "forbidden":
            sources = ", ".join(f"`{folder_of(m)}`" for m in c["source_modules"])
            forbidden = ", ".join(f"`{m}`" if "." not in m else f"`{folder_of(m)}`" for m in c["forbidden_modules"])
            lines.append(f"- {c['name']}: {sources} import none of {forbidden}.")
        elif c["type"] == "acyclic_siblings":
            lines.append(f"- {c['name']}: no cycle among the modules and subfolders of each of "
                         + ", ".join(f"`{folder_of(m)}`" for m in c["ancestors"]) + ".")
    return "\n".join(lines).rstrip() + "\n"


def current() -> str:
    text = DOC.read_text()
    start, end = text.index(BEGIN) + len(BEGIN) + 1, text.index(END)
    return text[start:end]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the table in docs/architecture.md")
    args = parser.parse_args()
    if args.write:
        text = DOC.read_text()
        start, end = text.index(BEGIN) + len(BEGIN) + 1, text.index(END)
        DOC.write_text(text[:start] + table() + text[end:])
        return 0
    sys.stdout.write(table())
    return 0 if current() == table() else 1


if __name__ == "__main__":
    sys.exit(main())
