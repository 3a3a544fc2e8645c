"""SSE framing: one write per worker message, the same bytes as one event per write."""

from __future__ import annotations

import asyncio
import json

from splitserve.services.frontend.errors import APIError
from splitserve.services.frontend.core import Delta
from splitserve.services.frontend.http.generation import event as _event, sse as _sse
from splitserve.services.frontend.http.app import _JSONResponse


class _Fmt:
    """Chat-like: an opening chunk, one chunk per delta, a usage chunk at the end."""

    def opening(self):
        return [{"role": "assistant"}]

    def chunks(self, delta):
        if not delta.text and delta.finish_reason is None:
            return []
        return [{"text": delta.text, "finish_reason": delta.finish_reason}]

    def closing(self):
        return [{"usage": {"completion_tokens": 3}}]


def _delta(text: str, finish_reason: str | None = None) -> Delta:
    return Delta(text, [1], [], finish_reason, 4, 0, 1)


async def _deltas(*items):
    for item in items:
        if isinstance(item, Exception):
            raise item
        yield item


def _writes(first, *rest) -> list[bytes]:
    async def collect():
        return [chunk async for chunk in _sse(_Fmt(), first, _deltas(*rest))]
    return asyncio.run(collect())


def _one_per_event(*payloads) -> bytes:
    return b"".join(f"data: {json.dumps(p, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()
                    for p in payloads) + b"data: [DONE]\n\n"


def test_one_write_per_message_and_the_end_in_one():
    writes = _writes(_delta("a"), _delta(""), _delta("é"), _delta("c", "length"))
    assert len(writes) == 3                 # opening+a, é, c+usage+[DONE]; the empty delta writes nothing
    assert writes[-1].endswith(b"data: [DONE]\n\n") and b'"finish_reason":"length"' in writes[-1]
    assert b"".join(writes) == _one_per_event(
        {"role": "assistant"}, {"text": "a", "finish_reason": None}, {"text": "é", "finish_reason": None},
        {"text": "c", "finish_reason": "length"}, {"usage": {"completion_tokens": 3}})


def test_first_message_finishing_is_a_single_write():
    writes = _writes(_delta("x", "stop"))
    assert writes == [_one_per_event({"role": "assistant"}, {"text": "x", "finish_reason": "stop"},
                                     {"usage": {"completion_tokens": 3}})]


def test_errors_mid_stream_are_reported_in_band():
    error = APIError(503, "the worker stopped", type="service_unavailable")
    writes = _writes(_delta("a"), error)
    assert b"".join(writes) == _one_per_event({"role": "assistant"}, {"text": "a", "finish_reason": None},
                                              error.body())
    early = _writes(_delta("a"))            # the worker's stream ends without a finish reason
    assert b'"the worker ended the stream early"' in early[-1] and early[-1].endswith(b"data: [DONE]\n\n")


def test_json_bodies_match_the_standard_encoding():
    body = {"id": "x", "choices": [{"text": "héllo \"q\"", "logprobs": None, "token_ids": [1, 2]}],
            "usage": {"prompt_tokens": 3, "x": -0.25}}
    assert _JSONResponse(body).body == json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    assert _event(body) == b"data: " + _JSONResponse(body).body + b"\n\n"


def test_unicode_line_separators_are_escaped_so_no_line_splitter_cuts_an_event():
    body = {"text": "a\u2028b\u2029c\x85d\u00e9"}
    data = _event(body)
    assert data.startswith(b"data: ") and data.endswith(b"\n\n")
    line = data[len(b"data: "):-2]
    assert len(line.decode().splitlines()) == 1 and "\u00e9".encode() in line
    assert json.loads(line) == body
