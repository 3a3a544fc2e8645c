"""The run's outputs: the JSON document and the summary tables.

JSON documents (`schema` says which):

- `splitserve.loadgen.run/1`: `config` (target, workload, arrivals, limits, SLO),
  `notes` (e.g. how a trace was scaled), `summary` (the aggregates of
  `metrics.summarize`: counts, `errors_by_kind`, `duration_s`, `requests_per_s`,
  `output_tokens_per_s`, `prompt_tokens_per_s`, `goodput_requests_per_s`,
  `slo_attainment`, and distributions `ttft_s`, `itl_s`, `e2e_s`, `chunk_gap_s`,
  `start_lag_s`, `output_tokens_per_request`, `request_output_tokens_per_s`, each with
  count/mean/p50/p90/p99/min/max) and `requests` (one `RequestRecord.to_json()`
  each).
- `splitserve.loadgen.sweep/1`: `config`, `notes`, `slo`, `slo_attainment_target`,
  `runs` (each: `rate`, `meets_slo`, `summary`, `requests`) and `best_rate`, the
  highest rate that met the SLOs (null when none did).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from rich.table import Table

from splitserve.errors import SplitserveError

RUN_SCHEMA = "splitserve.loadgen.run/1"
SWEEP_SCHEMA = "splitserve.loadgen.sweep/1"
LATENCIES = (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("E2E", "e2e_s"), ("chunk gap", "chunk_gap_s"))


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_document(config: dict, notes: list[str], summary: dict, records) -> dict:
    return {"schema": RUN_SCHEMA, "created": _now(), "config": config, "notes": notes,
            "summary": summary, "requests": [r.to_json() for r in records]}


def sweep_document(config: dict, notes: list[str], slo: dict, attainment_target: float,
                   runs: list[dict], best_rate: float | None) -> dict:
    return {"schema": SWEEP_SCHEMA, "created": _now(), "config": config, "notes": notes, "slo": slo,
            "slo_attainment_target": attainment_target, "runs": runs, "best_rate": best_rate}


def write_json(path: Path, document: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    return path


def load_document(path: Path) -> dict:
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise SplitserveError(f"cannot read {path}: {exc}") from None
    if not isinstance(document, dict) or document.get("schema") not in (RUN_SCHEMA, SWEEP_SCHEMA):
        raise SplitserveError(f"{path} is not a splitserve bench result (no known 'schema')")
    return document


# -- tables ----------------------------------------------------------------------------
def _num(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}"


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1000:,.1f}"


def summary_table(summary: dict, title: str = "splitserve bench") -> Table:
    """Throughput, counts and SLO figures of one run."""
    table = Table(title=title, show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    errors = ", ".join(f"{k}: {v}" for k, v in summary["errors_by_kind"].items()) or "none"
    slo = summary.get("slo") or {}
    slo_text = ", ".join(f"{k.removesuffix('_s')}<={v * 1000:g} ms" for k, v in slo.items() if v is not None)
    rows = [
        ("requests (ok / errors / cancelled)",
         f"{summary['num_ok']} / {summary['num_errors']} / {summary['num_cancelled']}"),
        ("errors by kind", errors),
        ("duration (s)", _num(summary["duration_s"])),
        ("requests/s", _num(summary["requests_per_s"], 3)),
        ("output tokens/s", _num(summary["output_tokens_per_s"], 1)),
        ("prompt tokens/s", _num(summary["prompt_tokens_per_s"], 1)),
        ("prompt tokens (cached)", f"{summary['total_prompt_tokens']:,} ({summary['total_cached_tokens']:,})"),
        ("output tokens", f"{summary['total_output_tokens']:,}"),
        (f"goodput req/s ({slo_text or 'no SLO'})", _num(summary["goodput_requests_per_s"], 3)),
        ("SLO attainment", "-" if summary["slo_attainment"] is None else f"{summary['slo_attainment']:.1%}"),
    ]
    lag = summary.get("start_lag_s") or {}
    if lag.get("count"):
        rows.append(("client start lag p50 / max (ms)", f"{_ms(lag['p50'])} / {_ms(lag['max'])}"))
    for name, value in rows:
        table.add_row(name, value)
    return table


def latency_table(summary: dict, title: str = "latency (ms)") -> Table:
    table = Table(title=title)
    for column in ("metric", "count", "mean", "p50", "p90", "p99", "max"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for name, key in LATENCIES:
        d = summary[key]
        table.add_row(name, str(d["count"]), *(_ms(d[f]) for f in ("mean", "p50", "p90", "p99", "max")))
    return table


def sweep_table(document: dict) -> Table:
    best = "none" if document["best_rate"] is None else f"{document['best_rate']:g}/s"
    table = Table(title=f"rate sweep (SLO attainment target {document['slo_attainment_target']:.0%}; "
                        f"best rate: {best}; latencies in ms)")
    for column in ("rate", "req/s", "good", "SLO%", "TTFT50", "TTFT99", "ITL50", "ITL99", "err", "ok?"):
        table.add_column(column, justify="right", no_wrap=True)
    for run in document["runs"]:
        s = run["summary"]
        attainment = "-" if s["slo_attainment"] is None else f"{s['slo_attainment']:.0%}"
        table.add_row(f"{run['rate']:g}", _num(s["requests_per_s"]), _num(s["goodput_requests_per_s"]),
                      attainment, _ms(s["ttft_s"]["p50"]), _ms(s["ttft_s"]["p99"]), _ms(s["itl_s"]["p50"]),
                      _ms(s["itl_s"]["p99"]), str(s["num_errors"]), "yes" if run["meets_slo"] else "no")
    return table


def print_run(console, document: dict) -> None:
    for note in document.get("notes", []):
        console.print(f"[dim]note: {note}[/dim]")
    console.print(summary_table(document["summary"]))
    console.print(latency_table(document["summary"]))


def print_sweep(console, document: dict) -> None:
    for note in document.get("notes", []):
        console.print(f"[dim]note: {note}[/dim]")
    console.print(sweep_table(document))
