"""Pieces the benchmark scripts share: rerunning noisy measurements, stopping a server's process group."""

from __future__ import annotations

import os
import signal
import subprocess
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
