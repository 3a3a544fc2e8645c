"""splitserve.testing.parallel: how `make test` splits the suite over two xdist workers.

The units of work (a module, or a named group) and the lock that lets an `alone` test run
with no other test. The lock is taken from threads here: flock locks belong to open files,
so two opens in one process exclude each other as two workers do. A thread that waits for
a lock shows in /proc/locks, so the tests wait for that instead of for a time.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from splitserve.testing.parallel import AloneLock, ModuleOrGroupScheduling
from splitserve.testing.waiting import wait_until


def test_a_module_is_one_unit_and_a_group_one_across_modules():
    scope = ModuleOrGroupScheduling._split_scope
    assert scope(None, "tests/unit/test_a.py::test_x") == "tests/unit/test_a.py"
    assert scope(None, "tests/unit/test_a.py::TestC::test_y[1-2]") == "tests/unit/test_a.py"
    assert scope(None, "tests/k8s/test_chart.py::test_z@k8s") == "@k8s"
    assert scope(None, "tests/k8s/test_e2e.py::test_w[a]@k8s") == "@k8s"
    # An '@' inside a parameter id is not a group.
    assert scope(None, "tests/unit/test_a.py::test_x[user@host]") == "tests/unit/test_a.py"


def _enter(lock: AloneLock, kind: str, log: list[str], name: str, hold: threading.Event) -> threading.Thread:
    def run():
        with getattr(lock, kind)():
            log.append(f"{name} in")
            hold.wait(10)
            log.append(f"{name} out")
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wait_for(log: list[str], entry: str) -> None:
    wait_until(lambda: entry in log, timeout=10, what=f"{entry!r} in the log", interval=0.01, details=lambda: log)


def _num_blocked_on(path: Path) -> int:
    """How many flock requests of this process wait for `path` (the "->" lines of /proc/locks)."""
    inode, pid = path.stat().st_ino, str(os.getpid())
    return sum(1 for line in Path("/proc/locks").read_text().splitlines()
               if "->" in line and line.split()[5] == pid and line.split()[6].endswith(f":{inode}"))


def _wait_blocked(path: Path, num_waiting: int = 1) -> None:
    wait_until(lambda: _num_blocked_on(path) >= num_waiting, timeout=10, interval=0.01,
               what=f"{num_waiting} lock request(s) waiting for {path.name}")


def test_shared_holders_run_together_and_an_alone_test_waits_for_both(tmp_path):
    lock, log = AloneLock(tmp_path), []
    release_shared, release_alone = threading.Event(), threading.Event()
    a = _enter(lock, "shared", log, "a", release_shared)
    b = _enter(lock, "shared", log, "b", release_shared)
    _wait_for(log, "a in")
    _wait_for(log, "b in")                     # two shared holders at once
    alone = _enter(lock, "exclusive", log, "alone", release_alone)
    _wait_blocked(lock.lock)                   # past the turnstile, waiting for a and b
    assert "alone in" not in log
    release_shared.set()
    _wait_for(log, "alone in")
    assert log.index("alone in") > max(log.index("a out"), log.index("b out"))
    release_alone.set()
    for t in (a, b, alone):
        t.join(10)


def test_a_waiting_alone_test_goes_before_a_later_shared_one(tmp_path):
    lock, log = AloneLock(tmp_path), []
    release_first, release_alone, release_later = threading.Event(), threading.Event(), threading.Event()
    first = _enter(lock, "shared", log, "first", release_first)
    _wait_for(log, "first in")
    alone = _enter(lock, "exclusive", log, "alone", release_alone)
    _wait_blocked(lock.lock)                   # the alone test holds the turnstile, waits for `first`
    later = _enter(lock, "shared", log, "later", release_later)
    _wait_blocked(lock.turnstile)              # the later one waits at the turnstile
    assert "later in" not in log and "alone in" not in log
    release_first.set()
    _wait_for(log, "alone in")
    assert _num_blocked_on(lock.turnstile) == 1 and "later in" not in log     # not beside an alone test
    release_alone.set()
    _wait_for(log, "later in")
    release_later.set()
    for t in (first, alone, later):
        t.join(10)
    assert log.index("alone out") < log.index("later in")
