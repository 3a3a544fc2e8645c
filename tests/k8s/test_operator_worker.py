"""The operator's two conversations with a real `splitserve worker` (no cluster needed):
the readiness canary (operator/controller/probe.py) and the drain RPCs (operator/controller/drain.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from operator_env import Worker

from splitserve.net import free_port
from splitserve.operator.drain import drain_and_measure


@pytest.fixture(scope="module")
def worker(llama_dir):
    w = Worker.start(llama_dir)
    try:
        yield w
    finally:
        w.stop()


def probe(address: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "splitserve.operator.probe", "--address", address,
                           "--timeout", "20"], capture_output=True, text=True, timeout=60)


def test_canary_passes_then_fails_once_draining(worker):
    ok = probe(worker.address)
    assert ok.returncode == 0, ok.stderr
    load = asyncio.run(drain_and_measure(worker.address))
    assert load is not None and load.idle
    refused = probe(worker.address)
    assert refused.returncode == 1 and "health is NOT_SERVING" in refused.stderr


def test_unreachable_worker():
    address = f"127.0.0.1:{free_port()}"
    assert asyncio.run(drain_and_measure(address)) is None
    refused = probe(address)
    assert refused.returncode == 1 and "health check failed: UNAVAILABLE" in refused.stderr
