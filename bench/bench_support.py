"""Pieces the benchmark scripts share: rerunning noisy measurements, waiting for and stopping a
server's process group, the machine's CPU load."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from collections.abc import Callable
from typing import TypeVar

R = TypeVar("R")


def quietest(run: Callable[[int], R], noise: Callable[[R], float], retries: int, max_noise: float) -> R:
    """`run(attempt)` until one's `noise` is at most `max_noise` (at most 1 + `retries` runs);
    returns the quietest."""
    best = None
    for attempt in range(1 + retries):
        result = run(attempt)
        if best is None or noise(result) < noise(best):
            best = result
        if noise(result) <= max_noise:
            break
    return best


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Poll `url` until it answers 200; RuntimeError if `proc` exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout:.0f} s")


def stop_group(proc: subprocess.Popen, wait_s: float) -> None:
    """SIGTERM a server started with start_new_session=True and its children; SIGKILL after `wait_s`."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine since boot, from /proc/stat (iowait counts as idle)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    return sum(values) - values[3] - values[4], sum(values)


def vllm_python() -> str:
    """The vLLM engine environment's python: SPLITSERVE_VLLM_PYTHON, else the default environment."""
    from splitserve.services.engine_vllm.environment import default_engine_python

    return os.environ.get("SPLITSERVE_VLLM_PYTHON") or str(default_engine_python())
