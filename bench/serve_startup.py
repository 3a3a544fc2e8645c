"""How long `splitserve serve` (default 1 prefill + 1 decode worker, the shipped SmolLM2) takes
from the command to `splitserve is ready`, and where the seconds go.

Each repetition runs, in alternating order:
- `default`: `splitserve serve` as the README starts it (CPU threads shared out among the ranks);
- `all-cores` (the baseline, same run): `--threads <cores>`, every rank with a torch pool of all
  cores, what serve did before it shared them out;
and, once at the start, `cold`: the first start on an empty model cache (SPLITSERVE_CACHE_DIR
set to a fresh folder, so the GGUF is converted again), default settings.
Phases come from the output itself: the time of serve's own first line, of each child's
`listening` line, the workers' own report of their phases (process and imports, model and KV
cache, KV transfer) and the ready line.

    python bench/serve_startup.py --reps 3 --out bench/results/serve_startup.json
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from splitserve.hardware import cpu_model, write_report
from splitserve.net import free_port

PHASE = re.compile(r"worker (\S+) ready \(transfer \w+\) .*process and imports ([\d.]+) s, model and KV cache "
                   r"([\d.]+) s, KV transfer ([\d.]+) s")


def start_once(extra: list[str], env: dict[str, str], timeout: float = 600) -> dict:
    port, gport = free_port(), free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "splitserve", "serve", "--port", str(port), "--grpc-port",
                             str(gport), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    marks: dict[str, float] = {}
    workers: dict[str, dict[str, float]] = {}
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.perf_counter() - t0
            marks.setdefault("first output", now)
            if "frontend gRPC listening" in line:
                marks.setdefault("frontend listening", now)
            if m := re.search(r"worker (\S+) listening", line):
                marks.setdefault(f"{m.group(1)} listening", now)
            if m := PHASE.search(line):
                workers[m.group(1)] = {"imports": float(m.group(2)), "model_kv": float(m.group(3)),
                                       "transfer": float(m.group(4)), "ready": now}
            if "splitserve is ready" in line:
                marks["ready"] = now
                break
            if now > timeout:
                break
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    if "ready" not in marks:
        raise SystemExit(f"serve {extra} did not get ready in {timeout:.0f} s")
    return {"seconds": marks["ready"], "marks": marks, "workers": workers}


def _summary(runs: list[dict]) -> dict:
    out = {"seconds": statistics.median(r["seconds"] for r in runs)}
    for phase in ("imports", "model_kv", "transfer"):
        out[f"worker_{phase}"] = statistics.median(w[phase] for r in runs for w in r["workers"].values())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    configs = {"default": [], "all-cores": ["--threads", str(cores)]}
    with tempfile.TemporaryDirectory() as cache:
        cold = start_once([], {**os.environ, "SPLITSERVE_CACHE_DIR": cache})
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    start_once([], dict(os.environ))                     # warm the page cache once
    for rep in range(args.reps):
        order = list(configs.items())
        for name, extra in order if rep % 2 == 0 else order[::-1]:
            runs[name].append(start_once(extra, dict(os.environ)))
    med = {name: _summary(r) for name, r in runs.items()}
    med["cold"] = _summary([cold])
    print(f"splitserve serve (1P+1D, shipped SmolLM2) on {cores} cores: {cpu_model()}")
    print(f"{'run':<34} {'ready s':>8} {'imports':>8} {'model+KV':>9} {'transfer':>9}")
    for name, label in (("cold", "cold (model converted)"), ("default", "warm, default"),
                        ("all-cores", "warm, --threads all cores (baseline)")):
        m = med[name]
        print(f"{label:<34} {m['seconds']:>8.2f} {m['worker_imports']:>8.2f} {m['worker_model_kv']:>9.2f} "
              f"{m['worker_transfer']:>9.2f}")
    ratio = med["default"]["seconds"] / med["all-cores"]["seconds"]
    print(f"{'ratio default / baseline':<34} {ratio:>8.2f}")
    print("first run's marks (s):", {k: round(v, 2) for k, v in runs["default"][0]["marks"].items()})
    if args.out:
        write_report(args.out, {"cores": cores, "reps": args.reps, "median": med,
                                "ratio_default_over_baseline": ratio, "runs": {**runs, "cold": [cold]}})


if __name__ == "__main__":
    main()
