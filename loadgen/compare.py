"""`splitserve bench compare A.json B.json`: every aggregate of two results side by side.

Aggregates are flattened to dotted names (`ttft_s.p99`, `errors_by_kind.http_503`);
sweeps are compared rate by rate (`rate=2/ttft_s.p50`) for the rates both hold,
plus `best_rate`. The ratio is A/B; it is left empty when B is zero or either side
is missing. Per-request data and settings are not compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from splitserve.errors import SplitserveError

from splitserve.loadgen.report import RUN_SCHEMA, load_document

_SKIP = {"slo"}       # settings echoed in the summary, not measurements


def flatten(summary: dict, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in summary.items():
        if key in _SKIP:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def aggregates(document: dict) -> dict[str, float]:
    if document["schema"] == RUN_SCHEMA:
        return flatten(document["summary"])
    out = {}
    for run in document["runs"]:
        out.update(flatten(run["summary"], f"rate={run['rate']:g}/"))
    if document.get("best_rate") is not None:
        out["best_rate"] = float(document["best_rate"])
    return out


@dataclass(slots=True)
class Row:
    name: str
    a: float | None
    b: float | None

    @property
    def ratio(self) -> float | None:
        if self.a is None or self.b is None or self.b == 0:
            return None
        return self.a / self.b


def compare(a: dict, b: dict) -> list[Row]:
    if a["schema"] != b["schema"]:
        raise SplitserveError("cannot compare a run with a sweep; compare two runs or two sweeps")
    fa, fb = aggregates(a), aggregates(b)
    names = list(fa) + [n for n in fb if n not in fa]
    return [Row(n, fa.get(n), fb.get(n)) for n in names]


def compare_table(rows: list[Row], label_a: str, label_b: str) -> Table:
    table = Table(title=f"A = {label_a}   B = {label_b}")
    for column in ("aggregate", "A", "B", "A/B"):
        table.add_column(column, justify="left" if column == "aggregate" else "right")
    for row in rows:
        table.add_row(row.name, _fmt(row.a), _fmt(row.b), "" if row.ratio is None else f"{row.ratio:.3f}")
    return table


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.6g}"


def compare_files(path_a: Path, path_b: Path) -> tuple[list[Row], Table]:
    rows = compare(load_document(path_a), load_document(path_b))
    return rows, compare_table(rows, str(path_a), str(path_b))
