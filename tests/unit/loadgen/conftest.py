"""Helpers for the loadgen unit tests: scripted SSE streams (on a FakeClock) over
`httpx.MockTransport`, and a stand-in vocabulary (one token per character) for
tests that do not need a real tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from splitserve.testing.clock import FakeClock


def sse(obj) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def chat_chunk(text: str | None, role: bool = False, finish: str | None = None) -> dict:
    delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            "usage": None}


def usage_chunk(prompt: int, completion: int, cached: int = 0) -> dict:
    return {"object": "chat.completion.chunk", "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}}


def scripted(clock: FakeClock, events: list[tuple[float, bytes]]):
    """A response body that sets the clock to t before handing out each event."""

    async def body():
        for t, data in events:
            clock.now = t
            yield data

    return body()


class FakeTokenizer:
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]


class FakeVocab:
    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()

    def count(self, text: str, add_special_tokens: bool = False) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture
def fake_vocab() -> FakeVocab:
    return FakeVocab()


@pytest.fixture(scope="session")
def llama_vocab(llama_dir: Path):
    from splitserve.loadgen.tokens import PromptVocab, load_tokenizer

    return PromptVocab(load_tokenizer(str(llama_dir)))


def mock_transport(handler) -> httpx.MockTransport:
    return httpx.MockTransport(handler)
