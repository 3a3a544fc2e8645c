"""`splitserve serve` as a user runs it: the shipped SmolLM2 behind two aggregated workers,
round-robin between them, Ctrl-C stopping everything; and clear refusals."""

from __future__ import annotations

import signal
import subprocess

import openai
import pytest

from .conftest import start_serve, stop_serve, worker_stats


@pytest.fixture(scope="module")
def smollm2_server(smollm2_dir):
    cache = smollm2_dir.parent.parent            # SPLITSERVE_CACHE_DIR layout: <cache>/models/<name>
    server = start_serve("smollm2", "--served-model-name", "smollm2", "--kv-cache-gib", "0.1",
                         env={"SPLITSERVE_CACHE_DIR": str(cache)}, num_workers=2)
    try:
        yield server
    finally:
        stop_serve(server, signal.SIGINT)        # what Ctrl-C sends


def test_smollm2_chat_through_two_round_robin_workers(smollm2_server):
    client = openai.OpenAI(base_url=smollm2_server.openai_url, api_key="unused", max_retries=0, timeout=120)
    answers = []
    for _ in range(2):
        out = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20, temperature=0)
        answers.append(out.choices[0].message.content)
        assert out.choices[0].finish_reason in ("stop", "length")
    assert all("Paris" in a for a in answers), answers
    assert answers[0] == answers[1]
    assert [worker_stats(a).num_requests for a in smollm2_server.worker_addresses] == [1, 1]


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["splitserve", "serve", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args, message", [
    ([], "disaggregated serving"),
    (["--prefill-workers", "2", "--decode-workers", "2"], "not available yet"),
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
                 "--transfer", "--host", "--port", "--grpc-port"):
        assert flag in result.stdout
    for sub in ("worker", "frontend"):
        assert subprocess.run(["splitserve", sub, "--help"], capture_output=True, timeout=60).returncode == 0
