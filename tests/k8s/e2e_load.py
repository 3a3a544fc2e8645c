"""Client load for the end-to-end tests: the official openai client, every answer checked token
for token against transformers' greedy output.

`stream()` is one streaming completion (token ids through `return_token_ids`);
`Load` keeps `concurrency` of them in flight on threads until stopped and counts
what was sent, completed, token-exact, and failed (with the error). A new client
per request: each request is its own connection, as a fleet of clients would
make, so a frontend pod that goes away ends no connection that is reused later.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import openai

from splitserve.testing.openai_api import served_model_name
from splitserve.testing.oracle import GreedyReference, assert_greedy_match


def stream(base: str, model: str, prompt: list[int], max_tokens: int,
           on_tokens: Callable[[int], None] | None = None) -> list[int]:
    client = openai.OpenAI(base_url=f"http://{base}/v1", api_key="unused", max_retries=0, timeout=180)
    tokens: list[int] = []
    try:
        for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True, "return_token_ids": True}):
            if chunk.choices:
                tokens += chunk.choices[0].model_extra.get("token_ids") or []
                if on_tokens is not None:
                    on_tokens(len(tokens))
    finally:
        client.close()
    return tokens


def served_model(base: str) -> str:
    """The model the frontend at `base` (HOST:PORT) serves."""
    return served_model_name(f"http://{base}/v1")


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    exact: int = 0
    failures: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, tokens: list[int] | None, ref: GreedyReference, error: str | None = None) -> None:
        with self._lock:
            if tokens is None:
                self.failures.append(error or "no answer")
                return
            self.completed += 1
            try:
                assert_greedy_match(tokens, ref)
                assert len(tokens) == len(ref.token_ids), f"{len(tokens)} tokens, not {len(ref.token_ids)}"
                self.exact += 1
            except AssertionError as e:
                self.failures.append(f"not token-exact: {e}")

    def summary(self) -> str:
        return f"sent {self.sent}, completed {self.completed}, token-exact {self.exact}, failed {len(self.failures)}"


def run_one(tally: Tally, base: str, model: str, prompt: list[int], ref: GreedyReference,
            on_tokens: Callable[[int], None] | None = None) -> None:
    with tally._lock:
        tally.sent += 1
    try:
        tokens = stream(base, model, prompt, len(ref.token_ids), on_tokens)
    except Exception as e:               # the tally names every failure; the test asserts there are none
        tally.record(None, ref, f"{type(e).__name__}: {e}")
        return
    tally.record(tokens, ref)


@dataclass
class Load:
    """`concurrency` streams in flight until stop(); each prompt from `cases` in turn."""

    base: str
    model: str
    cases: list[tuple[list[int], GreedyReference]]
    concurrency: int = 4
    tally: Tally = field(default_factory=Tally)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        for i in range(self.concurrency):
            t = threading.Thread(target=self._loop, args=(i,), daemon=True, name=f"load-{i}")
            t.start()
            self._threads.append(t)
        return self

    def _loop(self, i: int) -> None:
        turn = i
        while not self._stop.is_set():
            prompt, ref = self.cases[turn % len(self.cases)]
            run_one(self.tally, self.base, self.model, prompt, ref)
            turn += self.concurrency

    def stop(self, timeout: float = 120.0) -> Tally:
        """Stop sending; wait for the requests in flight to finish."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), f"requests still in flight after {timeout} s"
        return self.tally
