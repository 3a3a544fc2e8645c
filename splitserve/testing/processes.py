"""Child processes for tests and benchmarks: started, read, waited for, stopped.

A `Proc` collects its child's combined stdout and stderr on a reader thread, so a
test can wait for a line (`wait_for_line`, bounded, failing with what was printed)
and assert on the whole output afterwards (no API key in any line, no traceback).
Children run with one torch thread (CHILD_ENV): the test machines have 2 cores.

`stop_all` is the one shutdown path of every harness: SIGTERM to all at once (each
drains on its own), then SIGKILL whatever outlives the grace period, so nothing
outlives a test. The /proc readers (`child_pids`, `pid_alive`) check that a parent
took its children down with it; `ignores_signal` that a child is ready for a signal.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.testing.waiting import wait_until

CHILD_ENV = {"SPLITSERVE_TEST_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
READY_TIMEOUT_S = 120.0


@dataclass
class Proc:
    """A child process whose combined output is collected by a reader thread."""

    process: subprocess.Popen
    lines: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, argv: list[str], env: dict | None = None) -> "Proc":
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   stdin=subprocess.DEVNULL, env={**os.environ, **CHILD_ENV, **(env or {})})
        proc = cls(process)
        threading.Thread(target=proc._read, daemon=True).start()
        return proc

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.lines[-n:])

    def children(self) -> list[int]:
        return child_pids(self.process.pid)

    def wait_for_line(self, pattern: str, timeout: float = READY_TIMEOUT_S, after: int = 0) -> re.Match:
        """The first line matching `pattern` from line `after` on (a `len(proc.lines)` taken
        earlier: a line printed before that, say by an earlier restart, does not count);
        AssertionError with the output so far when the process exits first or `timeout` passes."""
        def matched() -> re.Match | None:
            exited = self.process.poll() is not None
            for line in list(self.lines)[after:]:
                if m := re.search(pattern, line):
                    return m
            if exited:
                raise AssertionError(f"exited ({self.process.returncode}) before a line matching {pattern!r}; "
                                     f"output:\n{self.output}")
            return None

        return wait_until(matched, timeout=timeout, what=f"a line matching {pattern!r}", interval=0.05,
                          details=lambda: f"output so far:\n{self.output}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0, must_stop: bool = False) -> int:
        """Signal, wait up to `timeout`, then SIGKILL; returns the exit code. With `must_stop`,
        a process that needed the SIGKILL fails the test (AssertionError)."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
            if must_stop:
                raise AssertionError(f"did not stop within {timeout} s on {sig!r}:\n{self.output}") from None
            return code


def stop_all(procs: list[Proc], grace_s: float) -> tuple[list[int], list[Proc]]:
    """SIGTERM every running process in `procs`, SIGKILL those still running `grace_s` later.

    Returns the exit codes of the processes that were running, in `procs` order, and the
    processes that needed the SIGKILL."""
    running = [p for p in procs if p.alive()]
    for p in running:
        p.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    codes, killed = [], []
    for p in running:
        try:
            codes.append(p.process.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.process.kill()
            codes.append(p.process.wait())
            killed.append(p)
    return codes, killed


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (read from /proc)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            pids.append(int(stat.parent.name))
    return pids


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def ignores_signal(pid: int, sig: int) -> bool:
    """Whether `pid` has set `sig` to be ignored (SigIgn in /proc/PID/status): a child that
    installs its handler first thing is ready for the signal once this says so."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    ignored = next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:"))
    return bool(int(ignored, 16) >> (sig - 1) & 1)
