"""Ray Serve test cases in a network namespace of their own (a child pytest under `unshare -n`).

Serve replicas and Ray's own servers listen on every interface, so the cases (a file pytest
does not collect by itself) run in a child pytest inside `unshare -n` with only `lo` up, with
HOME and Ray's temp dir in a scratch folder. The caller's test passes when every case passes;
it shows the child's report and checks that no process of that Ray outlives it.

When CI=true a missing dependency (ray, unshare, ip) fails instead of skipping.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


def _require(what: str, ok: bool) -> None:
    if ok:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} is missing (CI=true: `make test` installs it)")
    pytest.skip(f"{what} is missing")


def _pids_using(marker: str) -> list[int]:
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return [p for p in pids if p != os.getpid()]


RAY_STARTUP_TIMEOUT = "The current node timed out during startup"


def start_ray(attempts: int = 3, **init_kwargs) -> None:
    """`ray.init` in a case file, started again after Ray's own startup timeout.

    Ray gives its raylet a fixed 30 s to register with the GCS (ray/_private/node.py; no setting
    changes it), which a 2-core machine busy with the suite's other worker can miss. The failed
    start's processes (they hold RAY_TMPDIR in their command lines) are killed before the next.
    """
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(**init_kwargs)
            return
        except Exception as error:
            if RAY_STARTUP_TIMEOUT not in str(error) or attempt == attempts:
                raise
            print(f"ray.init attempt {attempt} of {attempts}: {error}; starting Ray again", file=sys.stderr)
            ray.shutdown()
            _kill_and_reap(_pids_using(init_kwargs.get("_temp_dir") or os.environ["RAY_TMPDIR"]))


def _kill_and_reap(pids: list[int]) -> None:
    from splitserve.testing.waiting import wait_until

    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_until(lambda: all(_gone(pid) for pid in pids), timeout=30, interval=0.05,
               what=f"the failed Ray start's processes {pids} to exit")


def _gone(pid: int) -> bool:
    """Exited: no /proc entry, or a zombie nobody here will reap (Ray's own children)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def run_ray_cases(cases: Path, root: Path, timeout_s: float, env: dict[str, str] | None = None) -> None:
    """Run the pytest file `cases` in a network namespace; fail with its report unless it passes."""
    _require("ray[serve] (the `ray` extra)", all(importlib.util.find_spec(m) for m in ("ray", "fastapi")))
    _require("unshare and ip (util-linux, iproute2)", bool(shutil.which("unshare") and shutil.which("ip")))
    _require("root (unshare -n needs CAP_SYS_ADMIN)", os.geteuid() == 0)
    scratch = tempfile.mkdtemp(prefix="ssray", dir="/tmp")      # short: Ray's socket paths are limited
    (Path(scratch) / "home").mkdir()
    env = {**os.environ, "HOME": f"{scratch}/home", "RAY_TMPDIR": f"{scratch}/t",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1",
           "SPLITSERVE_TEST_THREADS": "1", "SPLITSERVE_RAY_SCRATCH": scratch, "PYTHONUNBUFFERED": "1",
           **(env or {})}
    argv = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable, "-m", "pytest",
            "-p", "no:cacheprovider", "-q", "-x", "-rA", "--durations=0", "-W", "ignore::DeprecationWarning",
            f"--rootdir={root}", "-c", str(root / "pyproject.toml"), str(cases)]
    # The child's cwd is the scratch folder: `python -m pytest` puts the cwd on sys.path, and the
    # repository root has folders (operator/, router/) that must never be importable at top level.
    proc = subprocess.Popen(argv, cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the Ray cases took longer than {timeout_s:.0f} s:\n{output[-20000:]}")
    finally:
        leftovers = _pids_using(scratch)
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(scratch, ignore_errors=True)
    print(output)
    assert proc.returncode == 0, f"the Ray cases failed (exit {proc.returncode}):\n{output[-20000:]}"
    assert not leftovers, f"processes of the test's Ray outlived it: {leftovers}"
