"""A real worker and frontend for the fuzz tests, and the checks every fuzzed answer must pass.

One worker (random-weight Llama, aggregated) and one frontend per module, with
the default limits plus one API key (so the auth path is fuzzed as well; the
fuzzers send it). At the end of the module both processes must still be alive,
healthy and serving, exit cleanly on SIGTERM, and their logs must hold no
traceback and no unhandled-error line.
"""

from __future__ import annotations

import collections

import httpx
import pytest

from splitserve.testing.cluster import Cluster
from splitserve.testing.openai_api import served_model_name

API_KEY = "sk-fuzz-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


class Tally:
    """What the fuzzers sent and got: cases by status code."""

    def __init__(self) -> None:
        self.by_status: collections.Counter[int] = collections.Counter()
        self.by_refusal: collections.Counter[tuple] = collections.Counter()   # (status, code, param)
        self.messages: list[str] = []

    def add(self, status: int, body: bytes = b"") -> None:
        self.by_status[status] += 1
        if 400 <= status < 500:
            try:
                error = httpx.Response(status, content=body).json()["error"]
                self.by_refusal[(status, error.get("code"), error.get("param"))] += 1
                self.messages.append(error.get("message"))
            except (ValueError, KeyError, TypeError):
                self.by_refusal[(status, "unparsed", None)] += 1

    @property
    def num_cases(self) -> int:
        return sum(self.by_status.values())

    @property
    def num_5xx(self) -> int:
        return sum(n for s, n in self.by_status.items() if s >= 500)

    def summary(self, name: str) -> str:
        top = ", ".join(f"{s} {c} {p}: {n}" for (s, c, p), n in self.by_refusal.most_common(6))
        return (f"{name}: {self.num_cases} cases, 5xx={self.num_5xx}, by status "
                f"{dict(sorted(self.by_status.items()))}; most frequent refusals: {top}")


def assert_openai_error(status: int, body: bytes) -> None:
    """A refusal is a 4xx with {"error": {message, type, param, code}}."""
    assert 400 <= status < 500, (status, body[:500])
    error = httpx.Response(status, content=body).json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str), error


@pytest.fixture(scope="module")
def deployment(llama_dir):
    cluster = Cluster(llama_dir)
    try:
        worker = cluster.start_worker("worker-0", "both")
        worker.wait_ready()
        front = cluster.start_frontend(env={"SPLITSERVE_API_KEYS": API_KEY})
        front.wait_ready()
        yield cluster, front
        assert worker.proc.alive(), worker.proc.output[-3000:]
        assert front.proc.alive(), front.proc.output[-3000:]
        assert front.get("/health")[0] == 200 and front.get("/ready")[0] == 200
        model = served_model_name(front.openai_url, headers=AUTH)
        reply = httpx.post(f"{front.openai_url}/completions", headers=AUTH, timeout=60,
                           json={"model": model, "prompt": "still serving", "max_tokens": 3})
        assert reply.status_code == 200, reply.text
    finally:
        codes = cluster.close()
    assert codes == [0, 0], (codes, cluster.outputs()[-4000:])
    logs = cluster.outputs()
    assert "Traceback" not in logs and "unhandled error" not in logs, logs[-6000:]
    assert API_KEY not in logs


@pytest.fixture(scope="module")
def front(deployment):
    return deployment[1]


@pytest.fixture(scope="module")
def model_name(front) -> str:
    return served_model_name(front.openai_url, headers=AUTH)
