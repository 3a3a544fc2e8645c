"""The processes `splitserve serve` starts, and keeping them running.

Every child (worker, frontend) runs in one process group of its own, which
`stop()` signals as a whole (SIGTERM, then SIGKILL after a grace period); each
child also gets SIGTERM from the kernel if this process dies
(PR_SET_PDEATHSIG), so none outlives it, TP ranks (the worker's own children)
included.

Once the deployment is up, `supervise()` is called every poll: a child that
exited is started again with the same command line (same ports: the frontend
finds a restarted worker at its address, a new instance, and reconnects),
after a back-off that doubles from RESTART_BACKOFF_FIRST to RESTART_BACKOFF_MAX
and resets once a child has run RESTART_RESET_S; a worker whose gRPC health
check fails CANARY_FAILURES times in a row (hung, not dead) is killed and
restarted the same way. Requests that were on a lost worker migrate (the
frontend's work); a restarted child gets SPLITSERVE_RESTARTS, the number of
times it was restarted, which it reports in its /metrics.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.services.launch.children import GRACE_S
from splitserve.services.launch.probes import worker_serving
from splitserve.tls import PLAINTEXT, TlsConfig

RESTARTS_ENV = "SPLITSERVE_RESTARTS"
RESTART_BACKOFF_FIRST = 0.5
RESTART_BACKOFF_MAX = 15.0
RESTART_RESET_S = 60.0           # up this long: the next crash waits RESTART_BACKOFF_FIRST again
CANARY_EVERY_S = 2.0
CANARY_FAILURES = 3


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass(slots=True)
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen
    address: str = ""                 # host:port of a worker's gRPC service ("" for a frontend)
    started: float = field(default_factory=time.monotonic)
    restarts: int = 0
    backoff: float = RESTART_BACKOFF_FIRST
    restart_at: float | None = None   # exited: when it starts again
    canary_at: float = 0.0
    canary_failures: int = 0
    serving: bool = True              # last known: a worker's health said SERVING

    @property
    def is_worker(self) -> bool:
        return bool(self.address)


class Supervisor:
    def __init__(self, say: Callable[[str], None], tls: TlsConfig = PLAINTEXT, start_timeout_s: float = 600.0) -> None:
        self.children: list[Child] = []
        self.pgid: int | None = None
        self.say = say
        self.tls = tls
        self.start_timeout_s = start_timeout_s   # a restarted worker not yet SERVING is not failing

    def spawn(self, name: str, argv: list[str], address: str = "") -> Child:
        child = Child(name, argv, self._popen(argv, 0), address)
        self.children.append(child)
        return child

    def _popen(self, argv: list[str], restarts: int) -> subprocess.Popen:
        env = {**os.environ, RESTARTS_ENV: str(restarts)} if restarts else None
        try:
            process = subprocess.Popen(argv, process_group=self.pgid or 0, preexec_fn=_die_with_parent,
                                       stdin=subprocess.DEVNULL, env=env)
        except (OSError, subprocess.SubprocessError):
            if self.pgid is None:
                raise
            # Every member of the group is gone (its number no longer names a group): a new one.
            process = subprocess.Popen(argv, process_group=0, preexec_fn=_die_with_parent,
                                       stdin=subprocess.DEVNULL, env=env)
            self.pgid = process.pid
        if self.pgid is None:
            self.pgid = process.pid
        return process

    def exited(self) -> Child | None:
        return next((c for c in self.children if c.restart_at is None and c.process.poll() is not None), None)

    # ---- keeping the deployment up --------------------------------------------------

    def supervise(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for child in self.children:
            if child.restart_at is None and child.process.poll() is not None:
                self._schedule_restart(child, now, f"exited with code {child.process.returncode}")
            elif child.restart_at is not None and now >= child.restart_at:
                self._restart(child, now)
            elif child.is_worker and child.restart_at is None and now >= child.canary_at:
                self._canary(child, now)

    def _schedule_restart(self, child: Child, now: float, why: str) -> None:
        if now - child.started >= RESTART_RESET_S:
            child.backoff = RESTART_BACKOFF_FIRST
        child.restart_at = now + child.backoff
        self.say(f"splitserve: {child.name} {why}; restarting it in {child.backoff:.1f} s "
                 f"(restart {child.restarts + 1}; its requests move to the other workers)")
        child.backoff = min(child.backoff * 2, RESTART_BACKOFF_MAX)

    def _restart(self, child: Child, now: float) -> None:
        child.restarts += 1
        child.process = self._popen(child.argv, child.restarts)
        child.started, child.restart_at = now, None
        child.canary_failures, child.serving = 0, False
        child.canary_at = now + CANARY_EVERY_S
        self.say(f"splitserve: {child.name} restarted (pid {child.process.pid}, restart {child.restarts})")

    def _canary(self, child: Child, now: float) -> None:
        child.canary_at = now + CANARY_EVERY_S
        if worker_serving(child.address, self.tls):
            if not child.serving:
                self.say(f"splitserve: {child.name} is serving again ({now - child.started:.1f} s after its "
                         f"restart)")
            child.serving, child.canary_failures = True, 0
            return
        if not child.serving and now - child.started < self.start_timeout_s:
            return                    # still starting: loading a model is not a failed canary
        child.canary_failures += 1
        if child.canary_failures >= CANARY_FAILURES:
            self.say(f"splitserve: {child.name} failed {child.canary_failures} health checks in a row; "
                     f"killing it")
            try:
                os.kill(child.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.process.wait()
            child.canary_failures = 0
            self._schedule_restart(child, time.monotonic(), "was killed after failing its health checks")

    # ---- stopping --------------------------------------------------------------------

    def stop(self) -> None:
        if self.pgid is None:
            return
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for child in self.children:
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._signal(signal.SIGKILL)     # whatever is left in the group, grandchildren included
        for child in self.children:
            child.process.wait()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass
