"""What machine a benchmark ran on, for its JSON report (the CPU model varies between machines)."""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_report(path: str | Path, fields: dict) -> None:
    """A benchmark's JSON report at `path`: the commit and the CPU, then `fields`."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"commit": commit, "cpu": cpu_model(), **fields}, indent=2))
