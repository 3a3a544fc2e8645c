"""How fast the frontend process starts and how much memory it takes, against its libraries' floor.

Each repetition starts a fresh interpreter and measures, in it:
- `import`: importing the frontend's server module (splitserve.services.frontend.server),
  its wall time and the process's resident memory (VmRSS) afterwards, and whether torch
  got imported;
- `floor` (the baseline, same run): importing only the libraries any such frontend needs
  (fastapi, uvicorn, grpc, prometheus_client, tokenizers, jinja2, pydantic);
and, once per repetition, `splitserve frontend --model FOLDER` from exec to its first
200 on /health (a random-weight Llama folder; one worker address that nobody listens
on, so no worker is needed to answer /health).

    python bench/frontend_startup.py --reps 5 --out bench/results/frontend_startup.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from splitserve.hardware import write_report
from splitserve.net import free_port

PROBE = """
import json, sys, time
t0 = time.perf_counter()
{imports}
dt = time.perf_counter() - t0
rss = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS:'))
print(json.dumps({{"seconds": dt, "rss_mib": rss / 1024, "torch": "torch" in sys.modules}}))
"""
FRONTEND = "import splitserve.services.frontend.server"
FLOOR = "import fastapi, uvicorn, grpc, prometheus_client, tokenizers, jinja2, pydantic"


def _probe(imports: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)], capture_output=True,
                         text=True, check=True, timeout=120)
    return json.loads(out.stdout)


def _time_to_health(model: Path) -> tuple[float, float]:
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "splitserve", "frontend", "--model", str(model), "--port",
                             str(port), "--worker", f"decode=127.0.0.1:{free_port()}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.perf_counter() - t0 > 120:
                raise SystemExit(f"the frontend did not start (exit code {proc.returncode})")
            time.sleep(0.02)
        elapsed = time.perf_counter() - t0
        rss = next(int(line.split()[1]) for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:"))
        return elapsed, rss / 1024
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    from splitserve.testing.models import build_random_model

    rows: dict[str, list[dict]] = {"import": [], "floor": [], "process": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_random_model("llama", Path(tmp) / "model")
        for rep in range(args.reps):
            order = [("import", FRONTEND), ("floor", FLOOR)]
            for name, imports in order if rep % 2 == 0 else order[::-1]:    # alternate who goes first
                rows[name].append(_probe(imports))
            seconds, rss = _time_to_health(model)
            rows["process"].append({"seconds": seconds, "rss_mib": rss})
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("seconds", "rss_mib")} for k, v in rows.items()}
    torch_loaded = any(r["torch"] for r in rows["import"])
    print(f"{'measure':<34} {'median s':>9} {'RSS MiB':>8}")
    print(f"{'import frontend.server':<34} {med['import']['seconds']:>9.3f} {med['import']['rss_mib']:>8.1f}")
    print(f"{'import the libraries (baseline)':<34} {med['floor']['seconds']:>9.3f} {med['floor']['rss_mib']:>8.1f}")
    print(f"{'ratio frontend / baseline':<34} {med['import']['seconds'] / med['floor']['seconds']:>9.2f} "
          f"{med['import']['rss_mib'] / med['floor']['rss_mib']:>8.2f}")
    print(f"{'splitserve frontend to /health':<34} {med['process']['seconds']:>9.3f} {med['process']['rss_mib']:>8.1f}")
    print(f"torch imported by the frontend: {torch_loaded}")
    if args.out:
        write_report(args.out, {"reps": args.reps, "median": med, "torch_imported": torch_loaded, "runs": rows})


if __name__ == "__main__":
    main()
