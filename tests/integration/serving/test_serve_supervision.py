"""`splitserve serve` keeps serving when its own processes die: SIGKILL of a decode worker, of the
only decode worker, of the prefill worker, of the frontend — under streaming load through the
official openai client, every answer token-exact against transformers' greedy output, and the
killed process restarted and serving again (services/launch/supervisor.py)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import openai
import pytest

from splitserve.testing.metrics import scrape
from splitserve.testing.models import random_prompt
from splitserve.testing.oracle import assert_greedy_match, hf_greedy
from splitserve.testing.waiting import wait_until
from splitserve.testing.workers import wait_idle, worker_stats

from .conftest import Server, start_serve, stop_serve

LONG = 120          # tokens per stream: still streaming when the kill lands
BACK_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def cases(llama_dir: Path):
    prompts = [random_prompt(700 + i, 16 + 9 * i) for i in range(6)]
    return list(zip(prompts, hf_greedy(llama_dir, prompts, LONG, ignore_eos=True)))


def _serve(llama_dir: Path, decode_workers: int, *extra: str) -> Server:
    return start_serve(str(llama_dir), "--transfer", "tcp", "--prefill-workers", "1",
                       "--decode-workers", str(decode_workers), "--router", "round-robin", *extra,
                       num_workers=1 + decode_workers, aggregated=False)


def _pid_of(server: Server, name: str) -> int:
    """The pid of `serve`'s child named `name` (a worker's --worker-id, or "frontend")."""
    for pid in server.proc.children():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        args = [a.decode() for a in argv]
        if name == "frontend" and "frontend" in args:
            return pid
        if "--worker-id" in args and args[args.index("--worker-id") + 1] == name:
            return pid
    raise AssertionError(f"no child {name} of serve:\n{server.proc.tail()}")


def _stream(server: Server, prompt: list[int], max_tokens: int, seen: list[int]) -> list[int]:
    client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=120)
    tokens: list[int] = []
    with client:
        for chunk in client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                               max_tokens=max_tokens, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True, "return_token_ids": True}):
            if chunk.choices:
                tokens += chunk.choices[0].model_extra.get("token_ids") or []
                seen[0] = len(tokens)
    return tokens


def _kill_under_streams(server: Server, cases, victim: str, n: int = 24, after_tokens: int = 2):
    """n streams; SIGKILL `victim` once every stream has `after_tokens` tokens; (results, errors)."""
    results: list[list[int] | None] = [None] * n
    errors: list[str] = []
    progress = [[0] for _ in range(n)]

    def run(i: int) -> None:
        prompt, ref = cases[i % len(cases)]
        try:
            results[i] = _stream(server, prompt, len(ref.token_ids), progress[i])
        except Exception as e:              # the test asserts there are none, naming each
            errors.append(f"stream {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    wait_until(lambda: min(p[0] for p in progress) >= after_tokens or errors, timeout=120, interval=0.02,
               what=f"{after_tokens} tokens on every stream", details=lambda: f"progress: {progress}")
    os.kill(_pid_of(server, victim), signal.SIGKILL)
    killed_at = time.monotonic()
    for t in threads:
        t.join(180)
    return results, errors, killed_at


def _assert_exact(results, cases, errors) -> None:
    assert errors == [], errors
    for i, tokens in enumerate(results):
        _, ref = cases[i % len(cases)]
        assert tokens is not None
        assert_greedy_match(tokens, ref)
        assert len(tokens) == len(ref.token_ids)


def _metric(server: Server, name: str, **labels: str) -> float:
    return scrape(f"{server.base_url}/metrics", name, **labels)


def _back(server: Server, name: str, since: float) -> float:
    server.proc.wait_for_line(rf"splitserve: {name} is serving again", BACK_WITHIN_S + 10)
    took = time.monotonic() - since
    assert took < BACK_WITHIN_S, server.proc.tail()
    return took


@pytest.mark.parametrize("decode_workers", [2, 1])
def test_sigkill_of_a_decode_worker_loses_no_stream(llama_dir, cases, decode_workers):
    server = _serve(llama_dir, decode_workers)
    try:
        results, errors, killed_at = _kill_under_streams(server, cases, "decode-0")
        _assert_exact(results, cases, errors)
        took = _back(server, "decode-0", killed_at)
        print(f"\n[supervision] {decode_workers} decode worker(s): 24 streams, 24 token-exact after SIGKILL of "
              f"decode-0; serving again {took:.1f} s after the kill")
        assert "decode-0 exited with code -9; restarting it" in server.proc.output
        # The frontend sees it come back (a new instance at its address) and routes to it again.
        wait_until(lambda: _metric(server, "splitserve_worker_restarts_total", worker="decode-0") >= 1, timeout=10,
                   what="the frontend to count decode-0's restart", details=server.proc.tail)
        address = server.workers["decode-0"]
        before = worker_stats(address).num_requests
        for prompt, ref in cases[:2 * decode_workers]:
            assert _stream(server, prompt, 8, [0]) == ref.token_ids[:8]
        assert worker_stats(address).num_requests - before >= 1
        assert _metric(server, "splitserve_worker_restarts_total", worker="decode-0") == 1
        wait_idle(server.workers, 5.0)
    finally:
        stop_serve(server)


def test_sigkill_of_the_prefill_worker_loses_no_request(llama_dir, cases):
    server = _serve(llama_dir, 1)
    try:
        results, errors, killed_at = _kill_under_streams(server, cases, "prefill-0", n=12, after_tokens=0)
        _assert_exact(results, cases, errors)
        took = _back(server, "prefill-0", killed_at)
        print(f"\n[supervision] prefill worker SIGKILLed under 12 requests: 12 token-exact; serving again "
              f"{took:.1f} s after")
        wait_idle(server.workers, 5.0)
    finally:
        stop_serve(server)


def test_sigkill_of_the_frontend_restarts_it(llama_dir, cases):
    server = _serve(llama_dir, 1)
    try:
        os.kill(_pid_of(server, "frontend"), signal.SIGKILL)
        server.proc.wait_for_line(r"splitserve: frontend restarted", 20)
        def answer() -> list[int] | None:
            try:
                return _stream(server, cases[0][0], 16, [0])
            except (openai.APIConnectionError, openai.InternalServerError, openai.APIStatusError):
                return None

        tokens = wait_until(answer, timeout=BACK_WITHIN_S, interval=0.2, what="the restarted frontend to answer",
                            details=server.proc.tail)
        assert tokens == cases[0][1].token_ids[:16]
        assert _metric(server, "splitserve_process_restarts") == 1
        assert server.proc.alive()
    finally:
        stop_serve(server)
