"""JSON documents, tables, plots, `bench compare`, and the command line's parsing."""

from __future__ import annotations

import json

import pytest

from splitserve.errors import SplitserveError
from splitserve.loadgen import bench, metrics, report
from splitserve.loadgen.cli import parse_rates
from splitserve.loadgen.options import parse_slo
from splitserve.loadgen.compare import compare, compare_files, flatten
from splitserve.loadgen.metrics import SLO
from splitserve.loadgen.recorder import RequestRecord, records_from_json
from splitserve.services.cli import main as splitserve_cli

RUN_FIELDS = {"schema", "created", "config", "notes", "summary", "requests"}
SUMMARY_FIELDS = {"num_requests", "num_ok", "num_errors", "num_cancelled", "errors_by_kind", "duration_s",
                  "requests_per_s", "output_tokens_per_s", "prompt_tokens_per_s", "total_output_tokens",
                  "total_prompt_tokens", "total_cached_tokens", "goodput_requests_per_s", "slo_attainment", "slo",
                  "ttft_s", "itl_s", "e2e_s", "chunk_gap_s", "start_lag_s", "output_tokens_per_request",
                  "request_output_tokens_per_s"}
REQUEST_FIELDS = {"request_index", "conversation_id", "turn", "max_tokens", "num_prompt_tokens", "scheduled_s",
                  "start_s", "end_s", "group", "ok", "error_kind", "error", "status_code", "prompt_tokens",
                  "cached_tokens", "output_tokens", "output_tokens_source", "chunk_times_s", "ttft_s", "itl_s",
                  "e2e_s"}


def records(scale: float = 1.0) -> list[RequestRecord]:
    out = []
    for i in range(6):
        r = RequestRecord(request_index=i, conversation_id=f"c{i}", turn=0, max_tokens=4, num_prompt_tokens=9,
                          start_s=0.1 * i, end_s=0.1 * i + 0.5 * scale, ok=i != 5, prompt_tokens=9,
                          output_tokens=4, output_tokens_source="usage",
                          chunk_times_s=[0.1 * scale, 0.2 * scale, 0.3 * scale, 0.5 * scale])
        if i == 5:
            r.fail("http_503", "busy", 503)
        metrics.finish_record(r)
        out.append(r)
    return out


def run_doc(scale: float = 1.0) -> dict:
    recs = records(scale)
    return report.run_document({"label": f"x{scale}"}, ["a note"], metrics.summarize(recs, SLO(ttft_s=0.15)), recs)


def test_run_document_has_the_documented_fields(tmp_path):
    doc = run_doc()
    assert set(doc) == RUN_FIELDS and doc["schema"] == report.RUN_SCHEMA
    assert set(doc["summary"]) == SUMMARY_FIELDS
    assert set(doc["summary"]["ttft_s"]) == {"count", *metrics.DIST_FIELDS}
    assert all(set(r) == REQUEST_FIELDS for r in doc["requests"])
    path = report.write_json(tmp_path / "r.json", doc)
    again = report.load_document(path)
    assert again["summary"] == json.loads(json.dumps(doc["summary"]))
    assert [r.ttft_s for r in records_from_json(again["requests"])] == [r["ttft_s"] for r in doc["requests"]]
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(SplitserveError, match="not a splitserve bench result"):
        report.load_document(tmp_path / "other.json")


def test_outputs_and_tables(tmp_path):
    from rich.console import Console

    paths = bench.write_outputs(run_doc(), tmp_path)
    assert sorted(p.name for p in paths) == ["itl_cdf.png", "result.json", "throughput.png", "ttft_cdf.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
    console = Console(record=True, width=120)
    report.print_run(console, run_doc())
    text = console.export_text()
    assert "TTFT" in text and "http_503: 1" in text and "note: a note" in text


def test_sweep_outputs(tmp_path):
    runs = [{"rate": r, "meets_slo": r < 4, "summary": run_doc(r)["summary"], "requests": run_doc(r)["requests"]}
            for r in (1.0, 2.0, 4.0)]
    doc = report.sweep_document({}, [], SLO(ttft_s=0.15).describe(), 0.9, runs, 2.0)
    paths = bench.write_outputs(doc, tmp_path)
    assert "goodput_vs_rate.png" in [p.name for p in paths] and (tmp_path / "sweep.json").is_file()


def test_compare_gives_a_over_b_for_every_aggregate(tmp_path):
    a, b = run_doc(2.0), run_doc(1.0)
    rows = {row.name: row for row in compare(a, b)}
    assert set(rows) == set(flatten(a["summary"]))
    assert rows["ttft_s.p50"].ratio == pytest.approx(2.0)
    assert rows["e2e_s.mean"].ratio == pytest.approx(2.0)
    assert rows["num_ok"].ratio == pytest.approx(1.0)
    assert rows["errors_by_kind.http_503"].a == 1
    assert not any(name.startswith("slo.") for name in rows)
    pa, pb = report.write_json(tmp_path / "a.json", a), report.write_json(tmp_path / "b.json", b)
    _, table = compare_files(pa, pb)
    assert table.row_count == len(rows)


def test_bench_compare_subcommand(tmp_path, capsys):
    pa = report.write_json(tmp_path / "a.json", run_doc(2.0))
    pb = report.write_json(tmp_path / "b.json", run_doc(1.0))
    assert splitserve_cli.main(["bench", "compare", str(pa), str(pb)]) == 0
    out = capsys.readouterr().out
    assert "ttft_s.p50" in out and "2.000" in out
    assert splitserve_cli.main(["bench", "compare", str(pa), str(tmp_path / "missing.json")]) == 2


def test_bench_subcommand_help(capsys):
    with pytest.raises(SystemExit) as exc:
        splitserve_cli.main(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--url", "--workload", "--sweep-rates", "--slo", "--num-requests", "--duration", "--out"):
        assert flag in out


def test_slo_and_rate_parsing():
    assert parse_slo("ttft=0.5,itl=50ms") == SLO(ttft_s=0.5, itl_s=0.05)
    assert parse_slo("e2e=2s") == SLO(e2e_s=2.0)
    assert parse_slo(None) == SLO()
    for bad in ("ttft", "tpot=1", "ttft=abc"):
        with pytest.raises(SplitserveError):
            parse_slo(bad)
    assert parse_rates("1, 2,4.5") == [1.0, 2.0, 4.5]
    with pytest.raises(SplitserveError):
        parse_rates("1,-2")
