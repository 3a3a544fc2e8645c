"""How long this process has been running, for the start-up phases that workers and the
frontend print (`splitserve serve` shows them in its progress output).

The interpreter's start and the imports happen before any of our code runs, so the age
comes from the kernel (/proc/self/stat's start time against /proc/uptime), not a clock
started in main().
"""

from __future__ import annotations

import os
from pathlib import Path


def process_age_s() -> float:
    """Seconds since this process started (Linux); 0.0 where /proc cannot say."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])                   # field 22, starttime, in clock ticks since boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0
