"""`splitserve serve` as a user runs it: the shipped SmolLM2 behind the default deployment
(one prefill and one decode worker, the KV transfer over NIXL when importable), the official
openai client, Ctrl-C stopping everything; and clear refusals."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from splitserve.testing.workers import worker_stats

from .conftest import start_serve, stop_serve

EXPECTED_BACKEND = "nixl"        # the NIXL wheel is a test dependency (pip install 'splitserve[nixl]')


@pytest.fixture(scope="module")
def smollm2_server(smollm2_dir):
    """The default deployment: `splitserve serve` with no --model = the shipped SmolLM2, served as
    "smollm2", 1 prefill + 1 decode worker, NIXL when importable, on 127.0.0.1."""
    cache = smollm2_dir.parent.parent            # SPLITSERVE_CACHE_DIR layout: <cache>/models/<name>
    server = start_serve(None, "--kv-cache-gib", "0.1",
                         "--remote-prefill-threshold", "16", env={"SPLITSERVE_CACHE_DIR": str(cache)},
                         num_workers=2, aggregated=False)
    try:
        yield server
    finally:
        stop_serve(server, signal.SIGINT)        # what Ctrl-C sends


def test_smollm2_openai_client_against_default_serve(smollm2_server):
    assert "1 prefill and 1 decode worker(s)" in smollm2_server.proc.output
    assert f"KV transfer between prefill and decode workers: {EXPECTED_BACKEND}" in smollm2_server.proc.output
    client = openai.OpenAI(base_url=smollm2_server.openai_url, api_key="unused", max_retries=0, timeout=120)
    out = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20, temperature=0)
    answer = out.choices[0].message.content
    assert "Paris" in answer, answer
    assert out.choices[0].finish_reason in ("stop", "length")
    u = out.usage
    assert 1 <= u.completion_tokens <= 20 and u.prompt_tokens > 5
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    again = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20, temperature=0)
    assert again.choices[0].message.content == answer
    [prefill], [decode] = smollm2_server.role("prefill"), smollm2_server.role("decode")
    p, d = worker_stats(prefill), worker_stats(decode)
    # The first request went through the prefill worker; the repeat hit the decode worker's prefix cache.
    assert p.num_prefills_served == 1 and d.num_remote_prefills == 1 and d.num_local_prefills == 1, (p, d)
    assert d.num_used_kv_blocks == 0 and d.num_transfer_reservations == 0 and p.num_held_prefills == 0
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text and chunks[-1].usage.completion_tokens >= 1


README = Path(__file__).resolve().parents[3] / "README.md"
README_URL = "http://127.0.0.1:8000"          # where the README's examples expect `serve`


def _readme_examples() -> tuple[str, str]:
    """(the curl command, the Python example) that the README shows once `serve` is ready,
    as printed there (the test breaks when they change)."""
    text = README.read_text(encoding="utf-8")
    after = text[text.index("Once `serve` prints `splitserve is ready`"):]
    curl = re.search(r"```bash\n(curl .*?)```", after, re.DOTALL).group(1)
    python = re.search(r"```python\n(.*?)```", after, re.DOTALL).group(1)
    return curl.replace("\\\n", " "), python


def test_readme_examples_as_printed_answer_about_paris(smollm2_server):
    """The README's curl and Python examples, run as printed against the default `serve`
    (only the port differs), answer about Paris. They ask for temperature 0: with SmolLM2's
    published defaults (temperature 0.2, top_p 0.9, which the frontend applies to requests
    that omit them) the shipped Q4_1 model named Paris in 18 of 30 answers."""
    assert "temperature=0.2, top_p=0.9" in smollm2_server.proc.output      # the frontend's start-up line
    curl, python = _readme_examples()
    argv = [arg.replace(README_URL, smollm2_server.base_url) for arg in shlex.split(curl)]
    assert argv[0] == "curl" and README_URL in curl
    reply = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    answer = json.loads(reply.stdout)["choices"][0]["message"]["content"]
    print("README curl answered:", answer)
    assert "Paris" in answer, answer
    assert README_URL + "/v1" in python
    printed = subprocess.run([sys.executable, "-c", python.replace(README_URL + "/v1", smollm2_server.openai_url)],
                             capture_output=True, text=True, timeout=120, check=True).stdout
    print("README Python example printed:", printed)
    assert "Paris" in printed, printed


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["splitserve", "serve", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args, message", [
    (["--workers", "2"], "--aggregated"),
    (["--prefill-workers", "0"], "at least 1"),
    (["--aggregated", "--decode-workers", "2"], "--workers"),
    (["--aggregated", "--workers", "0"], "at least 1"),
])
def test_serve_refuses_clearly(args, message):
    result = _serve("--model", "/nonexistent", *args)
    assert result.returncode == 2
    assert "splitserve: error:" in result.stderr and message in result.stderr


def test_help_lists_the_flags():
    result = subprocess.run(["splitserve", "serve", "--help"], capture_output=True, text=True, timeout=60)
    for flag in ("--model", "--prefill-workers", "--decode-workers", "--aggregated", "--workers",
                 "--transfer", "--host", "--port", "--grpc-port", "--generation-config"):
        assert flag in result.stdout
    for sub in ("worker", "frontend"):
        result = subprocess.run(["splitserve", sub, "--help"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0
        assert ("--generation-config" in result.stdout) == (sub == "frontend")
