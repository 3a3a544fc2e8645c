"""The clients that drive each server in peers.py, and what one run of one reports.

- `splitserve-bench`: the project's own load generator (`splitserve bench`), a light client: a few
  hundredths of a core at concurrency 16.
- `aiperf`: AIPerf (`aiperf profile`, from PyPI), a common third-party client, run as a newcomer
  would; on 2 cores it used about 0.9 of a core beside the server (issue 37). It is installed once
  into a venv of its own, outside the repository and keyed by its pinned version
  (~/.cache/splitserve/peers/aiperf-<version>/, `SPLITSERVE_PEERS_CACHE` moves the folder), so
  neither its dependencies nor splitserve's move the other's.

Both send the same work: streaming chat, INPUT prompt tokens, `ignore_eos` and `min_tokens` so that
every request makes its OUTPUT tokens, a closed loop at the given concurrency, a fixed seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

AIPERF_VERSION = "0.13.0"
CACHE = Path(os.environ.get("SPLITSERVE_PEERS_CACHE", Path.home() / ".cache" / "splitserve" / "peers"))


@dataclass(slots=True, frozen=True)
class ClientSummary:
    """One client run: requests that completed and failed, output tokens/s over the run, and
    TTFT / ITL percentiles in seconds (ITL per request: decode time / (tokens - 1))."""

    completed: int
    errors: int
    duration_s: float
    output_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None


@dataclass(slots=True, frozen=True)
class Workload:
    url: str                    # http://HOST:PORT
    model: str                  # the served name
    tokenizer: str              # an HF folder with the model's tokenizer
    input_len: int
    output_len: int
    concurrency: int
    requests: int
    seed: int


class Client(Protocol):
    name: str

    def run(self, work: Workload, out: Path) -> ClientSummary:
        """Drive the server with `work`, keeping the client's files under `out`; raises
        RuntimeError when the client fails."""


def _run(cmd: list[str], what: str, env: dict | None = None, log: Path | None = None) -> None:
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL if log is None else log.open("w"),
                          stderr=subprocess.STDOUT if log is not None else subprocess.PIPE, text=True, env=env)
    if proc.returncode != 0:
        tail = log.read_text()[-3000:] if log is not None else (proc.stderr or "")[-3000:]
        raise RuntimeError(f"{what} failed ({proc.returncode}): {tail}")


# -- splitserve bench ---------------------------------------------------------------------------
class SplitserveBench:
    name = "splitserve-bench"

    def run(self, work: Workload, out: Path) -> ClientSummary:
        cmd = [sys.executable, "-m", "splitserve", "bench", "--url", work.url, "--model", work.model,
               "--tokenizer", work.tokenizer, "--api", "chat", "--input-len", str(work.input_len),
               "--output-len", str(work.output_len), "--arrival", "concurrency",
               "--concurrency", str(work.concurrency), "--num-requests", str(work.requests),
               "--seed", str(work.seed), "--out", str(out), "--no-plots", "--no-progress"]
        _run(cmd, "splitserve bench")
        summary = json.loads((out / "result.json").read_text())["summary"]
        dist = lambda key, q: (summary.get(key) or {}).get(q)  # noqa: E731
        return ClientSummary(completed=summary["num_ok"], errors=summary["num_errors"],
                             duration_s=summary.get("duration_s") or 0.0,
                             output_tokens_per_s=summary.get("output_tokens_per_s") or 0.0,
                             ttft_p50_s=dist("ttft_s", "p50"), ttft_p99_s=dist("ttft_s", "p99"),
                             itl_p50_s=dist("itl_s", "p50"), itl_p99_s=dist("itl_s", "p99"))


# -- AIPerf --------------------------------------------------------------------------------------
def aiperf_venv(version: str = AIPERF_VERSION, cache: Path = CACHE) -> Path:
    """The venv holding AIPerf `version`, installed from PyPI on first use."""
    venv = cache / f"aiperf-{version}"
    done = venv / ".installed"
    if not done.is_file():
        print(f"installing aiperf=={version} into {venv} (once)...", flush=True)
        _run([sys.executable, "-m", "venv", "--clear", str(venv)], "creating AIPerf's venv")
        _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"aiperf=={version}"],
             f"pip install aiperf=={version}")
        done.write_text(version + "\n")
    return venv


def aiperf_command(aiperf: Path, work: Workload, out: Path) -> list[str]:
    """`aiperf profile` for `work`: AIPerf's own defaults otherwise (client-side tokenization,
    server metrics scraped), as a newcomer runs it."""
    return [str(aiperf), "profile", "--model", work.model, "--url", work.url,
            "--endpoint-type", "chat", "--streaming",
            "--concurrency", str(work.concurrency), "--request-count", str(work.requests),
            "--isl", str(work.input_len), "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(work.output_len), "--prompt-output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{work.output_len}",
            "--tokenizer", work.tokenizer, "--random-seed", str(work.seed),
            "--output-artifact-dir", str(out), "--ui-type", "none"]


def parse_aiperf_export(path: Path) -> ClientSummary:
    """The summary of AIPerf's `profile_export_aiperf.json` (times there are in ms)."""
    d = json.loads(path.read_text())

    def stat(metric: str, key: str) -> float | None:
        value = (d.get(metric) or {}).get(key)
        return None if value is None else float(value)

    def seconds(metric: str, key: str) -> float | None:
        ms = stat(metric, key)
        return None if ms is None else ms / 1000.0

    if (d.get("time_to_first_token") or {}).get("unit", "ms") != "ms":
        raise ValueError(f"{path}: TTFT not in ms: AIPerf's export format moved (pinned {AIPERF_VERSION})")
    errors = sum(int(e.get("count", 1)) for e in d.get("error_summary") or [])
    return ClientSummary(completed=int(stat("request_count", "avg") or 0), errors=errors,
                         duration_s=stat("benchmark_duration", "avg") or 0.0,
                         output_tokens_per_s=stat("output_token_throughput", "avg") or 0.0,
                         ttft_p50_s=seconds("time_to_first_token", "p50"),
                         ttft_p99_s=seconds("time_to_first_token", "p99"),
                         itl_p50_s=seconds("inter_token_latency", "p50"),
                         itl_p99_s=seconds("inter_token_latency", "p99"))


class AIPerf:
    name = "aiperf"

    def __init__(self, version: str = AIPERF_VERSION):
        self.version = version
        self.venv = aiperf_venv(version)

    def run(self, work: Workload, out: Path) -> ClientSummary:
        # A local tokenizer folder loads without the Hub; HF_HUB_OFFLINE would make AIPerf look
        # the path up in the Hub's cache instead, and fail.
        env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1"}
        env.pop("HF_HUB_OFFLINE", None)
        out.mkdir(parents=True, exist_ok=True)
        _run(aiperf_command(self.venv / "bin" / "aiperf", work, out), "aiperf profile", env,
             log=out.parent / f"{out.name}.log")
        return parse_aiperf_export(out / "profile_export_aiperf.json")


CLIENTS = ("splitserve-bench", "aiperf")


def make_client(name: str) -> Client:
    return {"splitserve-bench": SplitserveBench, "aiperf": AIPerf}[name]()
