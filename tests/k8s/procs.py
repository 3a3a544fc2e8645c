"""Child processes of the test control plane: start, wait for health, stop.

Each component runs in its own process group with its output in a log file, and
is started with PR_SET_PDEATHSIG so that the kernel kills it if the pytest
process dies without running its finalizers (no orphaned apiservers holding
ports). Health is polled over HTTP(S) with a deadline; a component that exits
or never becomes healthy raises `ComponentError` with the tail of its log.
"""

from __future__ import annotations

import ctypes
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.testing.waiting import WaitTimeout, wait_until

_PR_SET_PDEATHSIG = 1


class ComponentError(RuntimeError):
    """A control-plane component failed to start or become healthy."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(slots=True)
class Component:
    """One running binary of the control plane."""

    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen | None = field(default=None, repr=False)

    def start(self, env: dict[str, str] | None = None) -> None:
        log = open(self.log_path, "ab")
        try:
            self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          preexec_fn=_die_with_parent, env=env)
        finally:
            log.close()

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except FileNotFoundError:
            return ""

    def check_running(self) -> None:
        """Raise ComponentError if the process has exited."""
        if self.popen is None:
            raise ComponentError(f"{self.name} was never started")
        code = self.popen.poll()
        if code is not None:
            raise ComponentError(f"{self.name} exited with code {code}; log {self.log_path}:\n"
                                 f"{self.log_tail()}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after `timeout` seconds; idempotent."""
        if self.popen is None:
            return
        pgid = self.popen.pid  # start_new_session: the child leads its own group
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.popen.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # The group may hold children that outlived the leader; they get SIGKILL too.
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _insecure_context() -> ssl.SSLContext:
    # The controller-manager and scheduler serve /healthz with self-signed certificates.
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def wait_healthy(component: Component, url: str, *, timeout: float, headers: dict[str, str] | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> float:
    """Poll `url` until it answers 200 "ok"; returns the seconds waited."""
    start = time.monotonic()
    if ssl_context is None and url.startswith("https:"):
        ssl_context = _insecure_context()
    last = "no answer yet"

    def healthy() -> bool:
        nonlocal last
        component.check_running()
        last = _health_answer(url, headers or {}, ssl_context)
        return last == "HTTP 200"

    try:
        wait_until(healthy, timeout=timeout, what=f"{component.name} healthy at {url}")
    except WaitTimeout:
        raise ComponentError(f"{component.name} not healthy at {url} after {timeout:.0f} s "
                             f"({last}); log {component.log_path}:\n{component.log_tail()}") from None
    return time.monotonic() - start


def _health_answer(url: str, headers: dict[str, str], ssl_context: ssl.SSLContext | None) -> str:
    """"HTTP <status>" (with the start of the body when it is an error), or why nothing answered."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2,
                                    context=ssl_context) as resp:
            return f"HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}: {e.read()[:300]!r}"
    except (urllib.error.URLError, OSError) as e:
        return str(e)
