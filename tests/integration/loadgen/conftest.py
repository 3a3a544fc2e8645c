"""Servers for the loadgen tests, all on 127.0.0.1.

`fake_server`: fake_openai_server.py in a child process, streaming OpenAI-style
SSE with delays and failures injected by the prompt (see that file).

`serve`: one real `splitserve serve --aggregated` on the random Llama test
model per module (about 10 s to start).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from splitserve.net import free_port
from splitserve.testing.waiting import wait_until

READY_TIMEOUT_S = 120.0


# -- the fake server (its own process: sharing this one's GIL would add milliseconds) --
@dataclass
class FakeServer:
    process: subprocess.Popen
    url: str


@pytest.fixture(scope="module")
def fake_server():
    script = Path(__file__).with_name("fake_openai_server.py")
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        match = re.match(r"listening on (\d+)", line)
        assert match, f"fake server did not start: {line!r}"
        yield FakeServer(process, f"http://127.0.0.1:{match.group(1)}")
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture(scope="session")
def llama_vocab(llama_dir):
    from splitserve.loadgen.tokens import PromptVocab, load_tokenizer

    return PromptVocab(load_tokenizer(str(llama_dir)))


# -- a real splitserve serve -------------------------------------------------------------
@dataclass
class Serve:
    process: subprocess.Popen
    url: str
    model: str
    log_path: str

    def output(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=1.0) as reply:
            return reply.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def serve(llama_dir, tmp_path_factory):
    port, grpc_port = free_port(), free_port()
    log_path = str(tmp_path_factory.mktemp("serve") / "serve.log")
    env = {**os.environ, "SPLITSERVE_TEST_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            ["splitserve", "serve", "--aggregated", "--model", str(llama_dir), "--port", str(port),
             "--grpc-port", str(grpc_port), "--threads", "1", "--kv-cache-gib", "0.05"],
            stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Serve(process, f"http://127.0.0.1:{port}", llama_dir.name, log_path)
    try:
        wait_until(lambda: _ready(server.url) or process.poll() is not None, timeout=READY_TIMEOUT_S, interval=0.2,
                   what="serve to be ready", details=server.output)
        assert process.poll() is None, server.output()
        yield server
    finally:
        process.terminate()
        try:
            assert process.wait(30) == 0, server.output()
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
