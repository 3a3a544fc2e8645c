"""The streaming client on scripted SSE streams (httpx.MockTransport) with a fake clock:
known timestamps in, known TTFT/ITL out; server misbehaviour becomes an error kind."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from splitserve.loadgen.client import Target, build_request, make_http_client, stream_request
from splitserve.loadgen.recorder import RequestRecord
from splitserve.testing.clock import FakeClock

from .conftest import chat_chunk, scripted, sse, usage_chunk

TARGET = Target("http://127.0.0.1:9/v1", "m", api="chat")


def run(handler, clock: FakeClock, vocab=None, timeout_s: float = 5.0, target: Target = TARGET) -> RequestRecord:
    prepared = build_request(target, vocab or _NoVocab(), [], "hello", 4)
    record = RequestRecord(request_index=0, conversation_id="c", turn=0, max_tokens=4,
                           num_prompt_tokens=prepared.num_prompt_tokens)

    async def go():
        async with make_http_client(transport=httpx.MockTransport(handler)) as http:
            await stream_request(http, target, prepared, record, clock, timeout_s, vocab)

    asyncio.run(go())
    return record


class _NoVocab:
    class tokenizer:                       # noqa: N801 - a stand-in namespace
        chat_template = None

    def count(self, text, add_special_tokens=False):
        return 0


def test_empty_chunks_do_not_count_as_first_token():
    clock = FakeClock()
    events = [(0.05, sse(chat_chunk(None, role=True))),     # role chunk, empty content
              (0.10, sse(chat_chunk(""))),                   # empty delta
              (0.20, sse(chat_chunk("Hel"))),
              (0.30, sse(chat_chunk(""))),
              (0.35, sse(chat_chunk("lo"))),
              (0.50, sse(chat_chunk(" you", finish="length"))),
              (0.52, sse(usage_chunk(7, 4, cached=3))),
              (0.55, sse("[DONE]"))]
    record = run(lambda req: httpx.Response(200, content=scripted(clock, events)), clock)
    assert record.ok, record.error
    assert record.chunk_times_s == pytest.approx([0.20, 0.35, 0.50])
    assert record.ttft_s == pytest.approx(0.20)
    assert record.e2e_s == pytest.approx(0.55)
    assert record.itl_s == pytest.approx((0.55 - 0.20) / 3)
    assert (record.prompt_tokens, record.output_tokens, record.cached_tokens) == (7, 4, 3)
    assert record.output_tokens_source == "usage"
    assert record.output_text == "Hello you"


def test_one_token_output():
    clock = FakeClock()
    events = [(0.1, sse(chat_chunk(None, role=True))), (0.4, sse(chat_chunk("A", finish="length"))),
              (0.41, sse(usage_chunk(5, 1))), (0.42, sse("[DONE]"))]
    record = run(lambda req: httpx.Response(200, content=scripted(clock, events)), clock)
    assert record.ok and record.output_tokens == 1
    assert record.ttft_s == pytest.approx(0.4) and record.itl_s is None


def test_without_usage_output_is_counted_with_the_tokenizer(fake_vocab):
    clock = FakeClock()
    events = [(0.1, sse(chat_chunk("ab"))), (0.2, sse(chat_chunk("cde"))), (0.3, sse("[DONE]"))]
    record = run(lambda req: httpx.Response(200, content=scripted(clock, events)), clock, fake_vocab)
    assert record.ok
    assert record.output_tokens == 5 and record.output_tokens_source == "tokenizer"


def test_request_body_streams_with_usage_and_exact_output_length():
    seen = {}

    def handler(request: httpx.Request):
        seen.update(json.loads(request.content))
        seen["path"] = request.url.path
        return httpx.Response(200, content=b"data: [DONE]\n\n")

    run(handler, FakeClock(), target=Target("http://127.0.0.1:9", "m", api="completions"))
    assert seen["path"] == "/v1/completions"
    assert seen["stream"] is True and seen["stream_options"] == {"include_usage": True}
    assert seen["max_tokens"] == 4 and seen["ignore_eos"] is True and seen["prompt"] == "hello"


@pytest.mark.parametrize("status", [400, 404, 429, 500, 503])
def test_http_errors_are_recorded(status):
    body = {"error": {"message": f"nope {status}", "type": "x"}}
    record = run(lambda req: httpx.Response(status, json=body), FakeClock())
    assert not record.ok
    assert record.error_kind == f"http_{status}" and record.status_code == status
    assert record.error == f"nope {status}"


def test_in_band_error_event_is_a_stream_error():
    clock = FakeClock()
    events = [(0.1, sse(chat_chunk("x"))), (0.2, sse({"error": {"message": "worker died"}})),
              (0.3, sse("[DONE]"))]
    record = run(lambda req: httpx.Response(200, content=scripted(clock, events)), clock)
    assert record.error_kind == "stream_error" and "worker died" in record.error


def test_stream_without_done_is_incomplete():
    clock = FakeClock()
    record = run(lambda req: httpx.Response(200, content=scripted(clock, [(0.1, sse(chat_chunk("x")))])), clock)
    assert record.error_kind == "incomplete"


def test_connection_failures_are_recorded():
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    assert run(refuse, FakeClock()).error_kind == "connect"

    def drop(request):
        raise httpx.RemoteProtocolError("peer closed connection", request=request)

    assert run(drop, FakeClock()).error_kind == "disconnected"


def test_bad_json_in_stream_is_recorded():
    record = run(lambda req: httpx.Response(200, content=b"data: {not json\n\n"), FakeClock())
    assert record.error_kind == "bad_response"


def test_a_request_that_takes_too_long_times_out():
    async def slow_body():
        yield sse(chat_chunk("x"))
        await asyncio.Event().wait()              # never finishes: only the client's timeout ends it
        yield sse("[DONE]")

    record = run(lambda req: httpx.Response(200, content=slow_body()), FakeClock(), timeout_s=0.05)
    assert record.error_kind == "timeout"


def test_multi_turn_prompt_holds_earlier_turns_and_answers(fake_vocab):
    chat = build_request(TARGET, fake_vocab, [("q1", " a1")], "q2", 3)
    assert [m["role"] for m in chat.body["messages"]] == ["user", "assistant", "user"]
    assert chat.body["messages"][1]["content"] == " a1"
    text = build_request(Target("u", "m"), fake_vocab, [("q1", " a1")], "q2", 3)
    assert text.body["prompt"] == "q1 a1 q2"
    assert text.num_prompt_tokens == 1 + len("q1 a1 q2")        # BOS added by the server for text
    ids = build_request(Target("u", "m", prompt_format="ids"), fake_vocab, [], "q2", 3)
    assert ids.body["prompt"] == [ord("q"), ord("2")] and ids.num_prompt_tokens == 2
