"""Hypothesis-generated hostile bodies against a real frontend and worker.

Valid chat and completion requests with one to three fields replaced by
arbitrary JSON (huge integers, floats, unicode, nested lists and objects, wrong
types), unknown fields, and raw texts no JSON encoder writes: numbers with
thousands of digits, NaN/Infinity, 5000-deep nesting, duplicate keys, lone
surrogates, invalid UTF-8, truncated bodies, megabyte strings, top-level
non-objects, under several content types. Every answer must be a 200 or a 4xx
with an OpenAI-style error body; the module's fixture then checks that both
processes are alive, healthy and serving, exit cleanly, and logged no
traceback. Deterministic (derandomize) with a fixed number of examples.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import AUTH, Tally, assert_openai_error

EXAMPLES = 150
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "seed", "stop", "stream", "stream_options", "logprobs", "top_logprobs", "n", "best_of",
          "logit_bias", "ignore_eos", "echo", "suffix", "user", "presence_penalty", "prompt_logprobs",
          "logprob_token_ids", "truncate_prompt_tokens", "truncation_side", "input", "unknown_field"]

scalars = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
           | st.sampled_from([0, 1, -1, 2**31, 2**63, -2**63 - 1, 2**64])
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40)
           | st.sampled_from(["", "\u0000", "\U0001f600" * 50, "\u202e", "a" * 3000]))
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)
RAW_VALUES = ["1" * 5000, "1e999", "-1e999", "NaN", "Infinity", "-Infinity", "1.0e-400", '"\\ud800"',
              '"\\udfff\\ud800"', "[" * 5000 + "]" * 5000, "{" * 3000, '"' + "x" * 2_000_000 + '"',
              "[" + ",".join(["1"] * 200_000) + "]", "true false", "0x10", "'single'"]


def base_body(model: str, chat: bool) -> dict:
    if chat:
        return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return {"model": model, "prompt": "hi", "max_tokens": 3}


@st.composite
def hostile_bodies(draw, model: str) -> tuple[bytes, str]:
    """(body bytes, content type)."""
    body = base_body(model, draw(st.booleans()))
    kind = draw(st.sampled_from(["json", "json", "raw", "duplicate", "truncated", "bytes", "toplevel"]))
    for field in draw(st.lists(st.sampled_from(FIELDS), min_size=0 if kind == "json" else 1, max_size=3,
                               unique=True)):
        body[field] = draw(json_values)
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 4)      # keep the requests that are served short
    text = json.dumps(body)
    if kind == "raw":
        field = draw(st.sampled_from(FIELDS))
        text = text[:-1] + f', "{field}": {draw(st.sampled_from(RAW_VALUES))}}}'
    elif kind == "duplicate":
        text = text[:-1] + f', "model": {json.dumps(draw(json_values))}, "messages": 5}}'
    elif kind == "truncated":
        text = text[:draw(st.integers(min_value=0, max_value=max(len(text) - 1, 0)))]
    elif kind == "toplevel":
        text = json.dumps(draw(json_values))
    data = text.encode("utf-8", "surrogatepass")
    if kind == "bytes":
        data = data[:-1] + draw(st.binary(min_size=1, max_size=16)) + b"}"
    content_type = draw(st.sampled_from(["application/json", "application/json", "text/plain", "",
                                         "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                         "application/json; charset=latin-1"]))
    return data, content_type


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/invocations"])
def test_hostile_bodies(front, model_name, path):
    tally = Tally()
    client = httpx.Client(base_url=front.base_url, timeout=60)

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=hostile_bodies(model_name))
    def run(case):
        data, content_type = case
        headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
        reply = client.post(path, content=data, headers=headers)
        tally.add(reply.status_code, reply.content)
        if reply.status_code != 200:
            assert_openai_error(reply.status_code, reply.content)

    try:
        run()
    finally:
        client.close()
    print(tally.summary(f"hostile bodies {path}"))
    assert tally.num_cases == EXAMPLES and tally.num_5xx == 0


def _raw_exchange(front, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", front.port), timeout=30) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_truncated_and_mismatched_bodies(front, model_name):
    """A Content-Length larger than what arrives (client gone), or smaller, or negative, and a
    truncated chunked body never hurt the server: a 4xx or a closed connection, then still healthy."""
    body = json.dumps(base_body(model_name, False)).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: " + AUTH["Authorization"].encode() + b"\r\n")
    answers = [_raw_exchange(front, head + b"Content-Length: 1000\r\n\r\n" + body[:20]),
               _raw_exchange(front, head + b"Content-Length: 10\r\n\r\n" + body),
               _raw_exchange(front, head + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\n0\r\n\r\n"),
               _raw_exchange(front, head + b"Content-Length: -1\r\n\r\n")]
    # Broken HTTP framing is answered by uvicorn itself (a plain-text 400) before the app sees
    # a request; the app's answers are OpenAI errors. Neither is ever a 5xx.
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 4") or not answer, answer[:300]
    assert front.get("/health")[0] == 200
