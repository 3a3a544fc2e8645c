"""How `make test` runs the suite on two pytest-xdist workers (tests/conftest.py wires it in).

Most of the suite's wall time is waiting: for worker processes to import torch and load a
model, for a control plane to reconcile, for pip to unpack wheels. Two workers overlap that
waiting. Three rules keep the tests' meaning:

- **A test module is one unit.** Its tests run in order on one worker, so a module-scoped
  server starts once (`--dist load` would start it on both workers).
- **A named group is one unit** (`@pytest.mark.xdist_group("name")`): every test on the
  Kubernetes control plane (one per session, `tests/k8s`), and the quick start (the longest
  test; it also holds 127.0.0.1:8000, where the README's `serve` listens). The conftest puts the groups first in
  the collection and `--no-loadscope-reorder` keeps its order: the groups are the longest
  units (a long unit started last would be the run's tail), and the quick unit tests, last,
  fill the gaps at the end.
- **A test marked `alone` runs while no other test does**: those whose assertions read
  latency or throughput (an SLO met again after a step, a measured p50). `AloneLock` is a
  reader-writer lock on files that all workers share: every other test holds it shared, an
  `alone` test exclusively; a turnstile lets a waiting `alone` test in before new shared holders.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from xdist.scheduler.loadgroup import LoadGroupScheduling


class ModuleOrGroupScheduling(LoadGroupScheduling):
    """--dist loadgroup, with a test's module (not the test alone) as its unit when it has no group."""

    def _split_scope(self, nodeid: str) -> str:
        if nodeid.rfind("@") > nodeid.rfind("]"):
            return "@" + nodeid.rsplit("@", 1)[-1]
        return nodeid.split("::", 1)[0]


class AloneLock:
    """The reader-writer lock of `alone` tests, on two files in `folder` (shared by all workers)."""

    def __init__(self, folder: Path):
        self.turnstile = folder / "alone.turnstile"
        self.lock = folder / "alone.lock"

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._held(self.turnstile, fcntl.LOCK_EX):
            pass                          # waits while an `alone` test waits or runs
        with self._held(self.lock, fcntl.LOCK_SH):
            yield

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._held(self.turnstile, fcntl.LOCK_EX), self._held(self.lock, fcntl.LOCK_EX):
            yield

    @staticmethod
    @contextmanager
    def _held(path: Path, mode: int) -> Iterator[None]:
        with open(path, "a+") as f:
            fcntl.flock(f, mode)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
