"""One benchmark: a run or a rate sweep, with progress, JSON, tables and plots.

`run_once` runs a workload once and returns the run document; `run_sweep` runs
it at each offered rate in turn (the same seeded workload every time), marks each
rate as meeting the SLOs when its attainment reaches the target, and reports the
highest rate that did. By default a sweep stops at the first rate that misses,
since higher rates only queue more. `write_outputs` writes `result.json` (or
`sweep.json`) and the PNGs into the output folder.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from splitserve.errors import SplitserveError

from splitserve.loadgen import metrics, plots, report
from splitserve.loadgen.arrivals import Arrivals, Concurrency, TraceSchedule
from splitserve.loadgen.client import Target
from splitserve.loadgen.recorder import Recorder, RequestRecord, records_from_json
from splitserve.loadgen.runner import Limits, Runner
from splitserve.loadgen.tokens import PromptVocab
from splitserve.loadgen.workloads import Workload


@dataclass(slots=True)
class BenchSpec:
    target: Target
    vocab: PromptVocab
    workload: Workload
    arrivals: Arrivals
    limits: Limits
    slo: metrics.SLO = field(default_factory=metrics.SLO)
    think_time_s: float = 0.0
    progress: bool = True
    label: str = "run"

    def config(self) -> dict:
        return {"label": self.label, "target": self.target.describe(),
                "workload": {"name": self.workload.name, **self.workload.params},
                "arrivals": self.arrivals.describe(), "limits": self.limits.describe(),
                "slo": self.slo.describe(), "think_time_s": self.think_time_s}


def _progress(console: Console, enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=console,
                    disable=not enabled, transient=False)


def _execute(spec: BenchSpec, arrivals: Arrivals, console: Console, description: str) -> list[RequestRecord]:
    total = spec.limits.max_requests
    if total is None and not spec.workload.cyclic:
        total = spec.workload.num_requests()
    with _progress(console, spec.progress) as progress:
        task = progress.add_task(description, total=total, status="")

        def update(rec: Recorder) -> None:
            errors = sum(rec.errors.values())
            progress.update(task, completed=rec.num_done,
                            status=f"ok {rec.num_ok}  errors {errors}  in flight {rec.num_in_flight}")

        runner = Runner(spec.target, spec.vocab, spec.workload, arrivals, spec.limits,
                        Recorder(on_change=update), spec.think_time_s)
        return asyncio.run(runner.run())


def run_once(spec: BenchSpec, console: Console | None = None) -> dict:
    console = console or Console(stderr=True)
    records = _execute(spec, spec.arrivals, console, spec.label)
    return report.run_document(spec.config(), spec.workload.notes, metrics.summarize(records, spec.slo), records)


def run_sweep(spec: BenchSpec, rates: list[float], attainment_target: float = 0.9,
              keep_going: bool = False, console: Console | None = None) -> dict:
    if isinstance(spec.arrivals, (Concurrency, TraceSchedule)):
        raise SplitserveError("a rate sweep needs poisson or constant arrivals (--arrival poisson|constant)")
    if not spec.slo.is_set():
        raise SplitserveError("a rate sweep needs an SLO (--slo ttft=...,itl=...)")
    console = console or Console(stderr=True)
    runs, best = [], None
    for rate in sorted(rates):
        records = _execute(spec, spec.arrivals.with_rate(rate), console, f"rate {rate:g}/s")
        summary = metrics.summarize(records, spec.slo)
        meets = summary["slo_attainment"] is not None and summary["slo_attainment"] >= attainment_target
        runs.append({"rate": rate, "meets_slo": meets, "summary": summary,
                     "requests": [r.to_json() for r in records]})
        if meets:
            best = rate
        elif not keep_going:
            break
    config = {**spec.config(), "sweep_rates": sorted(rates)}
    return report.sweep_document(config, spec.workload.notes, spec.slo.describe(), attainment_target, runs, best)


def write_outputs(document: dict, out_dir: Path, make_plots: bool = True) -> list[Path]:
    """The JSON file and, unless disabled, the PNGs; returns the paths written."""
    is_sweep = document["schema"] == report.SWEEP_SCHEMA
    paths = [report.write_json(out_dir / ("sweep.json" if is_sweep else "result.json"), document)]
    if make_plots:
        if is_sweep:
            series = [(f"{run['rate']:g}/s", records_from_json(run["requests"])) for run in document["runs"]]
            paths += plots.plot_all(series, out_dir, document)
        else:
            series = [(document["config"].get("label", "run"), records_from_json(document["requests"]))]
            paths += plots.plot_all(series, out_dir)
    return paths
