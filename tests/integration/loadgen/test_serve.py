"""Against a real `splitserve serve --aggregated` on the random Llama test model:
every workload runs, the JSON has the documented fields, and the token counts the
load generator reports are the server's own (prompt lengths built from the
tokenizer match the server's usage exactly; outputs are as asked)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from splitserve.loadgen import bench, datasets, workloads
from splitserve.loadgen import cli as loadgen_cli
from splitserve.loadgen.arrivals import Concurrency, Poisson, TraceSchedule
from splitserve.loadgen.bench import BenchSpec
from splitserve.loadgen.client import Target
from splitserve.loadgen.metrics import SLO
from splitserve.loadgen.report import RUN_SCHEMA, SWEEP_SCHEMA
from splitserve.loadgen.runner import Limits
from splitserve.loadgen.workloads import LengthDist, Workload

SUMMARY_KEYS = {"num_requests", "num_ok", "num_errors", "errors_by_kind", "requests_per_s", "output_tokens_per_s",
                "goodput_requests_per_s", "slo_attainment", "ttft_s", "itl_s", "e2e_s", "chunk_gap_s"}
REQUEST_KEYS = {"request_index", "conversation_id", "turn", "start_s", "end_s", "ok", "error_kind",
                "num_prompt_tokens", "prompt_tokens", "output_tokens", "output_tokens_source", "chunk_times_s",
                "ttft_s", "itl_s", "e2e_s"}


def _sharegpt_file(tmp_path):
    items = [{"id": f"q{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: what is {i} plus {i}? Please explain briefly."},
        {"from": "gpt", "value": f"{i} plus {i} is {2 * i}. " * (i + 1)},
        {"from": "human", "value": "And times two?"},
        {"from": "gpt", "value": f"That is {4 * i}."}]} for i in range(4)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(items))
    return path


def _workload(kind: str, vocab, tmp_path) -> tuple[Workload, object, str]:
    """(workload, arrivals, api) for each workload type, sized to a few requests."""
    out = LengthDist.parse("6")
    if kind == "synthetic":
        convs = workloads.synthetic(vocab, 6, LengthDist.parse("uniform:8:96"), out)
        return Workload(kind, convs), Poisson(50.0), "completions"
    if kind == "shared-prefix":
        convs = workloads.shared_prefix(vocab, 2, 64, 3, LengthDist.parse("12"), out)
        return Workload(kind, convs), Concurrency(2), "completions"
    if kind == "multi-turn":
        convs = workloads.multi_turn(vocab, 2, 3, LengthDist.parse("16"), out)
        return Workload(kind, convs), Concurrency(2), "chat"
    if kind == "trace":       # no path: the trace shipped with splitserve.loadgen
        workload = datasets.mooncake_trace(vocab, num_requests=6, block_tokens=8, max_output_tokens=6,
                                           time_scale=0.01)
        assert workload.params["path"] == str(datasets.shipped_trace_path())
        return workload, TraceSchedule(), "completions"
    assert kind == "sharegpt"
    return datasets.sharegpt(vocab, _sharegpt_file(tmp_path), max_turns=2, max_output_tokens=6), \
        Concurrency(2), "chat"


@pytest.mark.parametrize("kind", ["synthetic", "shared-prefix", "multi-turn", "trace", "sharegpt"])
def test_every_workload_runs_with_the_servers_token_counts(serve, llama_vocab, tmp_path, monkeypatch, kind):
    monkeypatch.delenv(datasets.TRACE_ENV, raising=False)
    workload, arrivals, api = _workload(kind, llama_vocab, tmp_path)
    spec = BenchSpec(Target(serve.url, serve.model, api=api), llama_vocab, workload, arrivals,
                     Limits(max_requests=8, request_timeout_s=60), SLO(ttft_s=5.0, itl_s=1.0), progress=False,
                     label=kind)
    document = bench.run_once(spec)
    records = document["requests"]
    assert records and all(r["ok"] for r in records), [r["error"] for r in records]
    for r in records:
        assert r["prompt_tokens"] == r["num_prompt_tokens"], r          # our count is the server's
        assert r["output_tokens"] == r["max_tokens"] and r["output_tokens_source"] == "usage"
        assert r["ttft_s"] is not None and r["e2e_s"] >= r["ttft_s"]
    summary = document["summary"]
    assert summary["total_output_tokens"] == sum(r["output_tokens"] for r in records)
    assert summary["num_ok"] == len(records) <= 8
    paths = bench.write_outputs(document, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "result.json").read_text())
    assert saved["schema"] == RUN_SCHEMA and SUMMARY_KEYS <= set(saved["summary"])
    assert all(REQUEST_KEYS <= set(r) for r in saved["requests"])
    assert {p.name for p in paths} >= {"ttft_cdf.png", "itl_cdf.png", "throughput.png"}
    if kind == "shared-prefix":
        assert summary["total_cached_tokens"] > 0                         # the tenants' prefixes were reused
    if kind == "trace":
        assert "scaled" in document["notes"][0]
    if kind in ("multi-turn", "sharegpt"):
        assert max(r["turn"] for r in records) >= 1


def test_token_id_prompts_are_exact(serve, llama_vocab):
    workload = Workload("synthetic", workloads.synthetic(llama_vocab, 4, LengthDist.parse("uniform:1:64"),
                                                         LengthDist.parse("1")))
    spec = BenchSpec(Target(serve.url, serve.model, prompt_format="ids"), llama_vocab, workload, Concurrency(4),
                     Limits(max_requests=4), progress=False)
    document = bench.run_once(spec)
    turns = [c.turns[0] for c in workload.conversations]
    assert [r["prompt_tokens"] for r in document["requests"]] == [t.num_tokens for t in turns]
    assert all(r["output_tokens"] == 1 and r["itl_s"] is None for r in document["requests"])


def test_sweep_finds_the_best_rate(serve, llama_vocab, tmp_path):
    workload = Workload("synthetic", workloads.synthetic(llama_vocab, 4, LengthDist.parse("16"),
                                                         LengthDist.parse("4")))
    spec = BenchSpec(Target(serve.url, serve.model), llama_vocab, workload, Poisson(1.0),
                     Limits(max_requests=4), SLO(ttft_s=10.0, itl_s=5.0), progress=False)
    document = bench.run_sweep(spec, [20.0, 10.0])
    assert document["schema"] == SWEEP_SCHEMA
    assert [run["rate"] for run in document["runs"]] == [10.0, 20.0]
    assert all(run["meets_slo"] for run in document["runs"]) and document["best_rate"] == 20.0
    paths = bench.write_outputs(document, tmp_path)
    assert "goodput_vs_rate.png" in {p.name for p in paths}


def test_command_line_run_and_compare(serve, llama_dir, tmp_path, capsys):
    common = ["--url", serve.url, "--model", str(llama_dir), "--workload", "shared-prefix", "--tenants", "2",
              "--prefix-len", "32", "--questions-per-tenant", "2", "--question-len", "8", "--output-len", "4",
              "--num-requests", "4", "--slo", "ttft=5,itl=1", "--no-progress"]
    a = subprocess.run(["splitserve", "bench", *common, "--out", str(tmp_path / "a")],
                       capture_output=True, text=True, timeout=120)
    assert a.returncode == 0, a.stderr
    assert "TTFT" in a.stdout and "goodput" in a.stdout
    for name in ("result.json", "ttft_cdf.png", "itl_cdf.png", "throughput.png"):
        assert (tmp_path / "a" / name).is_file(), name
    saved = json.loads((tmp_path / "a" / "result.json").read_text())
    assert saved["config"]["target"]["model"] == serve.model and saved["summary"]["num_ok"] == 4
    # the same in-process (the torch import is already paid for here), then compare via `python -m`
    assert loadgen_cli.main([*common, "--concurrency", "1", "--no-plots", "--out", str(tmp_path / "b")]) == 0
    cmp = subprocess.run([sys.executable, "-m", "splitserve.loadgen", "compare", str(tmp_path / "a" / "result.json"),
                          str(tmp_path / "b" / "result.json")], capture_output=True, text=True, timeout=60)
    assert cmp.returncode == 0, cmp.stderr
    assert "ttft_s.p50" in cmp.stdout and "A/B" in cmp.stdout


def test_trace_workload_needs_no_path(serve, llama_dir, tmp_path, monkeypatch):
    monkeypatch.delenv(datasets.TRACE_ENV, raising=False)
    code = loadgen_cli.main(["--url", serve.url, "--model", str(llama_dir), "--workload", "trace",
                             "--num-requests", "2", "--trace-block-tokens", "8", "--trace-max-output", "4",
                             "--trace-time-scale", "0.001", "--no-progress", "--no-plots",
                             "--out", str(tmp_path / "t")])
    assert code == 0
    saved = json.loads((tmp_path / "t" / "result.json").read_text())
    assert saved["config"]["workload"]["path"] == str(datasets.shipped_trace_path())
    assert saved["summary"]["num_ok"] == 2 and "conversation_trace.jsonl" in saved["notes"][0]


def test_missing_trace_fails_clearly(serve, llama_dir, tmp_path, capsys):
    code = loadgen_cli.main(["--url", serve.url, "--model", str(llama_dir), "--workload", "trace",
                             "--trace", str(tmp_path / "nope.jsonl"), "--num-requests", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "Mooncake trace not found" in err and "--trace" in err
