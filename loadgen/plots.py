"""PNG plots of a run or a sweep (matplotlib, Agg backend: no display needed).

- `ttft_cdf.png`: CDF of time to first token, one line per run;
- `itl_cdf.png`: CDF of per-request inter-token latency (solid) and of
  inter-chunk gaps (dashed);
- `throughput.png`: output tokens/s over the run (binned) and requests in flight;
- `goodput_vs_rate.png` (sweeps): achieved throughput and goodput against the
  offered rate, with SLO attainment and its target.

Each function takes `(label, records)` series and an output folder and returns
the path it wrote, so a sweep overlays its rates on the same axes.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from splitserve.loadgen import metrics  # noqa: E402
from splitserve.loadgen.recorder import RequestRecord  # noqa: E402

Series = list[tuple[str, list[RequestRecord]]]


def _cdf(ax, values: list[float], label: str, **style) -> None:
    xs = sorted(v * 1000 for v in values if v is not None)
    if xs:
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})", **style)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cdf_axes(title: str, xlabel: str):
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("cumulative fraction")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    return fig, ax


def ttft_cdf(series: Series, out_dir: Path) -> Path:
    fig, ax = _cdf_axes("Time to first token (CDF)", "TTFT (ms)")
    for label, records in series:
        _cdf(ax, [r.ttft_s for r in records if r.ok], label)
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, out_dir / "ttft_cdf.png")


def itl_cdf(series: Series, out_dir: Path) -> Path:
    fig, ax = _cdf_axes("Inter-token latency (CDF)", "milliseconds")
    for i, (label, records) in enumerate(series):
        color = f"C{i % 10}"
        ok = [r for r in records if r.ok]
        _cdf(ax, [r.itl_s for r in ok], f"{label} ITL per request", color=color)
        _cdf(ax, [g for r in ok for g in metrics.chunk_gaps(r.chunk_times_s)], f"{label} inter-chunk gap",
             color=color, linestyle="--", alpha=0.7)
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, out_dir / "itl_cdf.png")


def _in_flight(records: list[RequestRecord], times: list[float]) -> list[int]:
    t0 = min(r.start_s for r in records)
    spans = [(r.start_s - t0, (r.end_s if r.end_s is not None else r.start_s) - t0) for r in records]
    return [sum(1 for a, b in spans if a <= t < b) for t in times]


def throughput(series: Series, out_dir: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.set_title("Output throughput over time")
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.set_ylabel("requests in flight")
    for i, (label, records) in enumerate(series):
        if not records:
            continue
        bin_s = max(0.25, metrics.span(records) / 60)
        times, rates = metrics.throughput_timeline(records, bin_s)
        ax.plot(times, rates, color=f"C{i % 10}", label=f"{label} tokens/s ({bin_s:.2g} s bins)")
        if times:
            ax2.plot(times, _in_flight(records, times), color=f"C{i % 10}", linestyle=":", alpha=0.7,
                     label=f"{label} in flight")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right", fontsize=8)
    ax.set_ylim(bottom=0)
    ax2.set_ylim(bottom=0)
    return _save(fig, out_dir / "throughput.png")


def goodput_vs_rate(document: dict, out_dir: Path) -> Path:
    """From a sweep document: offered rate vs achieved req/s and goodput, plus attainment."""
    runs = document["runs"]
    rates = [run["rate"] for run in runs]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.set_title("Goodput vs offered rate")
    ax.set_xlabel("offered rate (conversations/s)")
    ax.set_ylabel("requests/s")
    ax.grid(alpha=0.3)
    ax.plot(rates, [run["summary"]["requests_per_s"] or 0 for run in runs], "o-", label="achieved req/s")
    ax.plot(rates, [run["summary"]["goodput_requests_per_s"] or 0 for run in runs], "s-", label="goodput req/s")
    ax2 = ax.twinx()
    ax2.set_ylabel("SLO attainment")
    ax2.set_ylim(0, 1.05)
    ax2.plot(rates, [run["summary"]["slo_attainment"] or 0 for run in runs], "^:", color="C2",
             label="SLO attainment")
    ax2.axhline(document["slo_attainment_target"], color="C3", linestyle="--", alpha=0.6, label="target")
    if document.get("best_rate") is not None:
        ax.axvline(document["best_rate"], color="C3", alpha=0.3, label="best rate")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", fontsize=8)
    return _save(fig, out_dir / "goodput_vs_rate.png")


def plot_all(series: Series, out_dir: Path, sweep_document: dict | None = None) -> list[Path]:
    paths = [ttft_cdf(series, out_dir), itl_cdf(series, out_dir), throughput(series, out_dir)]
    if sweep_document is not None:
        paths.append(goodput_vs_rate(sweep_document, out_dir))
    return paths
