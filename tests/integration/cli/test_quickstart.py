"""The README's quick start as a newcomer runs it: a fresh clone, a fresh venv, the first command
exactly as the README prints it (install, then `splitserve serve`), then the README's curl and
Python examples against it.

The commands are read out of README.md, so the test breaks when the README changes and its
commands stop working. pip's own cache (the test suite's install filled it) supplies torch, so
the venv costs an unpack, not a download. `serve` listens where the README says,
127.0.0.1:8000; the test fails at once, saying so, when something else holds that port.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
README = REPO / "README.md"
INSTALL_TIMEOUT_S = 1500.0        # a cold pip cache downloads torch and its CUDA libraries
# Its own xdist unit, started first (splitserve/testing/parallel.py): the suite's longest test.
pytestmark = pytest.mark.xdist_group("quickstart")


def _blocks(text: str, lang: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(rf"```{lang}\n(.*?)```", text, re.DOTALL)]


def readme_commands() -> dict[str, str]:
    """The quick start's two commands and the two examples, as README.md prints them."""
    text = README.read_text()
    quick = text[text.index("## Quick start"):]
    bash, python = _blocks(quick, "bash"), _blocks(quick, "python")
    return {"install_and_serve": bash[0], "test": bash[1], "curl": bash[2], "python": python[0]}


def test_readme_commands_are_what_ci_runs():
    commands = readme_commands()
    assert commands["install_and_serve"].endswith("splitserve serve")
    assert commands["test"] == "make test"
    assert "make test" in (REPO / ".ci" / "run").read_text()


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_fresh_clone_fresh_venv_readme_first_command_then_its_examples(tmp_path: Path):
    commands = readme_commands()
    assert _port_free(8000), "127.0.0.1:8000, where the README's serve listens, is taken by another process"
    clone = tmp_path / "splitserve"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True, timeout=120)
    venv = clone / ".venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", VIRTUAL_ENV=str(venv), PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    serve = subprocess.Popen(["bash", "-c", commands["install_and_serve"]], cwd=clone, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    lines: list[str] = []
    try:
        ready_at = installed_at = None
        assert serve.stdout is not None
        for line in serve.stdout:
            lines.append(line.rstrip())
            if installed_at is None and "starting 1 prefill and 1 decode worker" in line:
                installed_at = time.monotonic()
            if "splitserve is ready: http://127.0.0.1:8000/v1" in line:
                ready_at = time.monotonic()
                break
            if time.monotonic() - t0 > INSTALL_TIMEOUT_S:
                break
        tail = "\n".join(lines[-60:])
        assert ready_at is not None, f"not ready after {time.monotonic() - t0:.0f} s:\n{tail}"
        print(f"\n[quickstart] install + first start {ready_at - t0:.0f} s "
              f"(install until the workers started: {(installed_at or ready_at) - t0:.0f} s)")
        # The venv's own splitserve, from the clone: not the test suite's install.
        where = subprocess.run([str(venv / "bin" / "python"), "-c", "import splitserve; print(splitserve.__file__)"],
                               capture_output=True, text=True, env=env, cwd=venv, timeout=60)
        assert where.stdout.strip() == str(clone / "splitserve" / "__init__.py"), where

        curl = subprocess.run(["bash", "-c", commands["curl"]], capture_output=True, text=True, env=env,
                              timeout=120)
        assert curl.returncode == 0 and '"choices"' in curl.stdout, (curl.stdout, curl.stderr)
        assert "Paris" in curl.stdout, curl.stdout           # the README promises a right answer
        print(f"[quickstart] curl example: {curl.stdout[:400]}")
        # The README's Python example needs the openai client, which the README says to install.
        install_openai = _openai_install_line(README.read_text())
        subprocess.run(["bash", "-c", install_openai], check=True, env=env, cwd=clone, timeout=600,
                       capture_output=True)
        example = subprocess.run([str(venv / "bin" / "python"), "-c", commands["python"]], capture_output=True,
                                 text=True, env=env, cwd=venv, timeout=120)
        assert example.returncode == 0 and "Paris" in example.stdout, (example.stdout, example.stderr)
        print(f"[quickstart] Python example printed: {example.stdout.strip()[:400]}")
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGINT)            # Ctrl-C, as the user would stop it
            try:
                serve.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
                serve.wait()
                raise AssertionError("serve did not stop on Ctrl-C:\n" + "\n".join(lines[-40:])) from None
        shutil.rmtree(clone, ignore_errors=True)           # the venv is gigabytes (torch's CUDA libraries)
        # Every process of the session is gone (serve, its workers, their ranks).
        assert subprocess.run(["pgrep", "-s", str(serve.pid)], capture_output=True).stdout == b""


def _openai_install_line(text: str) -> str:
    m = re.search(r"`(python3 -m pip install openai[^`]*)`", text)
    assert m, "the README must say how to install the openai client its Python example uses"
    return m.group(1)
