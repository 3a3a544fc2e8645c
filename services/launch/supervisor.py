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
restarted the same way. A serving worker that answers NOT_SERVING is draining (a SIGTERM
from outside serve): it is left to finish its drain and shutdown and exit (then restarted),
and its health checks count again only RETIRE_KILL_S after its drain began. Requests that were on a lost worker migrate (the
frontend's work); a restarted child gets SPLITSERVE_RESTARTS, the number of
times it was restarted, which it reports in its /metrics.

`serve --autoscale` (local_scaling.py) adds and removes workers while this runs, from its
own thread, so every method that reads or changes the children holds `lock`. A worker
spawned `starting=True` is not health-checked until it first answers SERVING (or
`start_timeout_s` passes). `retire()` takes a worker out of supervision (no restart,
no canary) and sends it SIGTERM, which drains it (services/worker/shutdown.py);
`reap_retired()` returns the retired children that have exited, SIGKILLing one that
outlives RETIRE_KILL_S.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from grpc_health.v1 import health_pb2

from splitserve.services.launch.children import GRACE_S
from splitserve.services.launch.probes import worker_health
from splitserve.tls import PLAINTEXT, TlsConfig

RESTARTS_ENV = "SPLITSERVE_RESTARTS"
RESTART_BACKOFF_FIRST = 0.5
RESTART_BACKOFF_MAX = 15.0
RESTART_RESET_S = 60.0           # up this long: the next crash waits RESTART_BACKOFF_FIRST again
CANARY_EVERY_S = 2.0
CANARY_FAILURES = 3
RETIRE_KILL_S = 60.0             # a retired (draining) child still running this long is killed


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
    retired_at: float | None = None   # retire(): when its SIGTERM (drain) was sent
    draining_since: float | None = None   # a serving worker answered NOT_SERVING: draining (SIGTERM from outside)
    own_group: bool = False           # outside the children's group: stopped after them (the local etcd)
    env: dict[str, str] | None = None # set in its environment (on top of this process's)

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
        self.retired: list[Child] = []           # taken out of supervision, draining (retire())
        self.lock = threading.RLock()            # the autoscaler spawns and retires from its thread

    def spawn(self, name: str, argv: list[str], address: str = "", starting: bool = False,
              own_group: bool = False, env: dict[str, str] | None = None) -> Child:
        """Start a child and supervise it. `starting`: a worker added while the deployment runs,
        not yet SERVING (its health checks count only once it is, or after start_timeout_s).
        `own_group`: a service the others need until they have stopped (the local etcd the
        workers deregister from): in a process group of its own, stopped after the others."""
        with self.lock:
            child = Child(name, argv, self._popen(argv, 0, own_group, env), address, own_group=own_group, env=env)
            if starting:
                child.serving = False
                child.canary_at = child.started + CANARY_EVERY_S
            self.children.append(child)
            return child

    def retire(self, child: Child) -> None:
        """Stop supervising `child` and send it SIGTERM (a worker drains, then exits)."""
        with self.lock:
            if child in self.children:
                self.children.remove(child)
            self.retired.append(child)
            child.retired_at = time.monotonic()
            if child.process.poll() is None:
                try:
                    os.kill(child.process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def reap_retired(self, now: float | None = None) -> list[Child]:
        """The retired children that have exited since the last call; one still running
        RETIRE_KILL_S after its retirement is SIGKILLed (and returned once it is gone)."""
        now = time.monotonic() if now is None else now
        gone = []
        with self.lock:
            for child in list(self.retired):
                if child.process.poll() is None and now - child.retired_at >= RETIRE_KILL_S:
                    self.say(f"splitserve: {child.name} still running {RETIRE_KILL_S:.0f} s after its drain "
                             f"began; killing it")
                    _kill(child)
                if child.process.poll() is not None:
                    self.retired.remove(child)
                    gone.append(child)
        return gone

    def _popen(self, argv: list[str], restarts: int, own_group: bool = False,
               extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        env = None                       # this process's
        if restarts or extra_env:
            env = {**os.environ, **(extra_env or {})}
            if restarts:
                env[RESTARTS_ENV] = str(restarts)
        if own_group:
            return subprocess.Popen(argv, process_group=0, preexec_fn=_die_with_parent,
                                    stdin=subprocess.DEVNULL, env=env)
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
        with self.lock:
            return next((c for c in self.children if c.restart_at is None and c.process.poll() is not None),
                        None)

    # ---- keeping the deployment up --------------------------------------------------

    def supervise(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self.lock:
            for child in list(self.children):
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
        child.process = self._popen(child.argv, child.restarts, child.own_group, child.env)
        child.started, child.restart_at = now, None
        child.canary_failures, child.serving, child.draining_since = 0, False, None
        child.canary_at = now + CANARY_EVERY_S
        self.say(f"splitserve: {child.name} restarted (pid {child.process.pid}, restart {child.restarts})")

    def _canary(self, child: Child, now: float) -> None:
        child.canary_at = now + CANARY_EVERY_S
        status = worker_health(child.address, self.tls)
        if status == health_pb2.HealthCheckResponse.SERVING:
            if not child.serving and child.restarts:      # (a new worker's autoscaler says when it is)
                self.say(f"splitserve: {child.name} is serving again ({now - child.started:.1f} s after its "
                         f"restart)")
            child.serving, child.canary_failures, child.draining_since = True, 0, None
            return
        if status == health_pb2.HealthCheckResponse.NOT_SERVING and child.serving and child.draining_since is None:
            # It answers but takes no new work: it is draining (a SIGTERM from outside serve). Its
            # running streams get its drain timeout, then its server stops and the process exits
            # (which restarts it). Killing it meanwhile would cut the drain or its shutdown short.
            child.draining_since = now
            self.say(f"splitserve: {child.name} is draining; it restarts once it exits")
        if child.draining_since is not None and now - child.draining_since < RETIRE_KILL_S:
            return                    # draining or shutting down: failing only after RETIRE_KILL_S
        if not child.serving and now - child.started < self.start_timeout_s:
            return                    # still starting: loading a model is not a failed canary
        child.canary_failures += 1
        if child.canary_failures >= CANARY_FAILURES:
            self.say(f"splitserve: {child.name} failed {child.canary_failures} health checks in a row; "
                     f"killing it")
            _kill(child)
            child.canary_failures = 0
            self._schedule_restart(child, time.monotonic(), "was killed after failing its health checks")

    # ---- stopping --------------------------------------------------------------------

    def stop(self) -> None:
        with self.lock:
            last = [c for c in self.children if c.own_group]
            everyone = [c for c in [*self.children, *self.retired] if not c.own_group]
            if self.pgid is not None:
                self._signal(signal.SIGTERM)
                deadline = time.monotonic() + GRACE_S
                for child in everyone:
                    try:
                        child.process.wait(max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        pass
                self._signal(signal.SIGKILL)     # whatever is left in the group, grandchildren included
                for child in everyone:
                    child.process.wait()
            for child in last:
                if child.process.poll() is None:
                    child.process.terminate()
                try:
                    child.process.wait(GRACE_S)
                except subprocess.TimeoutExpired:
                    child.process.kill()
                    child.process.wait()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass


def _kill(child: Child) -> None:
    """SIGKILL one child process (not its group) and reap it."""
    try:
        os.kill(child.process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.process.wait()
