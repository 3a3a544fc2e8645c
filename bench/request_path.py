"""Which files one disaggregated chat request runs through, per process, and where it crosses packages.

Starts `splitserve serve` (1 prefill + 1 decode worker, the frontend) on a random-weight
Llama with every process loading bench/request_path/sitecustomize.py, a profile hook
that records the repository's files and caller -> callee file pairs between SIGUSR1 and
SIGUSR2. Warm-up requests run until one was prefilled remotely (so the workers' channels and
transfer connections exist, as they do in steady state); then it records exactly one
streamed chat request whose prompt is long enough to be prefilled remotely, checks in the
decode worker's Stats that it was, and prints, per process, the files it
ran and the package crossings (a call from one package's file into another package's).
A package is a top-level folder, or services/<part> (services/frontend/http counts as
services/frontend). This is a reading aid, not a speed benchmark: the hook slows
everything down, and no baseline applies; run it on two commits to compare layouts.

    python bench/request_path.py --out bench/results/request_path.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx
import psutil

from bench_support import wait_ready
from splitserve.hardware import cpu_model

REPO = Path(__file__).resolve().parents[1]


def package_of(path: str) -> str:
    parts = Path(path).resolve().relative_to(REPO).parts
    if parts[0] == "services" and len(parts) > 2:
        return f"services/{parts[1]}"
    return parts[0] if len(parts) > 1 else "."


def role_of(argv: list[str]) -> str:
    if "frontend" in argv:
        return "frontend"
    if "--role" in argv:
        return f"{argv[argv.index('--role') + 1]} worker"
    return " ".join(argv[-2:])


def _chat(base: str, content: str) -> str:
    body = {"model": "m", "stream": True, "max_tokens": 8,
            "messages": [{"role": "user", "content": content}]}
    models = httpx.get(f"{base}/v1/models", timeout=10).json()
    body["model"] = models["data"][0]["id"]
    text = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text.append(line)
    return "".join(text)


def _remote_prefills(address: str) -> int:
    """The decode worker's count of prompts a prefill worker prefilled for it."""
    import grpc

    from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=30).num_remote_prefills


def trace(model: Path, port: int, trace_dir: Path) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "bench" / "request_path"), SPLITSERVE_TRACE_ROOT=str(REPO),
               SPLITSERVE_TRACE_OUT=str(trace_dir), OMP_NUM_THREADS="1")
    log_path = trace_dir / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "splitserve", "serve", "--model", str(model), "--transfer",
                                 "tcp", "--port", str(port), "--threads", "1", "--kv-cache-gib", "0.05"],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{base}/ready", proc, 300)
        decode = re.search(r"worker decode-0 listening on (\S+)", log_path.read_text())[1]
        prompt = " ".join(f"word{i}" for i in range(150))          # > the 64-token remote-prefill threshold
        for attempt in range(5):
            _chat(base, f"warm up {attempt} " + prompt)
            if _remote_prefills(decode):
                break
        else:
            raise SystemExit("no warm-up request was prefilled remotely: see " + str(log_path))
        before = _remote_prefills(decode)
        children = psutil.Process(proc.pid).children(recursive=True)
        for c in children:
            os.kill(c.pid, signal.SIGUSR1)
        time.sleep(1.0)
        _chat(base, "traced " + prompt)
        time.sleep(1.0)
        for c in children:
            os.kill(c.pid, signal.SIGUSR2)
        time.sleep(2.0)
        if _remote_prefills(decode) != before + 1:
            raise SystemExit("the traced request was not prefilled remotely; nothing to report")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    return [json.loads(p.read_text()) for p in trace_dir.glob("*.json")]


def summarize(dumps: list[dict]) -> dict:
    out = {}
    for d in dumps:
        if not d["files"]:
            continue
        role = role_of(d["argv"])
        crossings = defaultdict(int)
        for caller, callee in d["edges"]:
            a, b = package_of(caller), package_of(callee)
            if a != b:
                crossings[f"{a} -> {b}"] += 1
        out[role] = {"files": [str(Path(f).resolve().relative_to(REPO)) for f in d["files"]],
                     "loaded": [str(Path(f).resolve().relative_to(REPO)) for f in d.get("loaded", [])],
                     "torch": d.get("torch"),
                     "packages": sorted({package_of(f) for f in d["files"]}),
                     "crossings": dict(sorted(crossings.items()))}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=18080)
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    from splitserve.testing.models import build_random_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_random_model("llama", Path(tmp) / "model")
        trace_dir = Path(tmp) / "trace"
        trace_dir.mkdir()
        report = summarize(trace(model, args.port, trace_dir))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    print(f"{'process':<16} {'files':>5} {'packages':>8} {'crossing pairs':>14} {'crossing calls':>14} "
          f"{'modules loaded':>14} {'torch':>5}")
    total_files = set()
    for role, r in sorted(report.items()):
        total_files.update(r["files"])
        print(f"{role:<16} {len(r['files']):>5} {len(r['packages']):>8} {len(r['crossings']):>14} "
              f"{sum(r['crossings'].values()):>14} {len(r['loaded']):>14} {str(r['torch']):>5}")
    print(f"{'all processes':<16} {len(total_files):>5}")
    for role, r in sorted(report.items()):
        print(f"\n{role}: " + ", ".join(r["crossings"]))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"commit": commit, "cpu": platform.processor() or cpu_model(),
                                              "processes": report, "num_files": len(total_files)}, indent=2))


if __name__ == "__main__":
    main()
