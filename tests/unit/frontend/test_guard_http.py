"""GuardMiddleware, the HTTP gatekeeper, around a small recording ASGI app.

Driven through in-memory ASGI receive/send: open paths, API keys (401), per-client
concurrency and rate (429 with Retry-After; the rate limiter's clock is stepped, not
slept on), the body limit (413 before the app sees anything), the request timeout
(504 before the response, in-band once it streams; the app is cancelled), and the
refusal counter for each. The same limits against a real frontend process are in
tests/integration/security/test_limits.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import orjson
import pytest

from splitserve.services.frontend.guard import GuardMiddleware
from splitserve.services.frontend.asgi import DONE
from splitserve.testing.clock import FakeClock
from splitserve.testing.waiting import async_wait_until

from .conftest import counted_guard

KEY, OTHER_KEY = "sk-unit-1", "sk-unit-2"


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    messages: list[dict]

    def error(self) -> dict:
        return orjson.loads(self.body)["error"]


@dataclass
class RecordingApp:
    """The app behind the guard: answers `status` with the number of body bytes it read.

    /v1/hold waits for `release` first; /v1/never* never finish (until cancelled), having
    sent nothing, the start of an SSE stream (-streamed) or of a JSON response (-whole)."""

    status: int = 200
    release: asyncio.Event = field(default_factory=asyncio.Event)
    bodies: list[bytes] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    async def __call__(self, scope, receive, send) -> None:
        self.paths.append(scope["path"])
        body = b""
        if scope["method"] == "POST":
            message = await receive()
            body = message["body"]
            assert not message.get("more_body", False)        # the guard replays the whole body at once
        self.bodies.append(body)
        try:
            if scope["path"] == "/v1/hold":
                await self.release.wait()
            elif scope["path"].startswith("/v1/never"):
                await self._hang(scope["path"], send)
        except asyncio.CancelledError:
            self.cancelled.append(scope["path"])
            raise
        payload = orjson.dumps({"read": len(body)})
        await send({"type": "http.response.start", "status": self.status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload, "more_body": False})

    @staticmethod
    async def _hang(path: str, send) -> None:
        if path == "/v1/never-streamed":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        elif path == "/v1/never-whole":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
        await asyncio.Event().wait()


async def _call(guard: GuardMiddleware, path: str = "/v1/completions", method: str = "POST",
                chunks: tuple[bytes, ...] = (b"{}",), key: str | None = None, client: str = "10.0.0.1",
                headers: dict[str, str] | None = None) -> Reply:
    headers = dict(headers or {})
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    scope = {"type": "http", "method": method, "path": path, "client": (client, 5000),
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    incoming: asyncio.Queue = asyncio.Queue()
    for i, chunk in enumerate(chunks):
        incoming.put_nowait({"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1})
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await guard(scope, incoming.get, send)
    start = sent[0]
    return Reply(start["status"], {k.decode(): v.decode() for k, v in start.get("headers", ())},
                 b"".join(m.get("body", b"") for m in sent[1:]), sent)


def test_open_paths_need_no_key_and_other_paths_do():
    guard, rejected = counted_guard((KEY,))
    app = RecordingApp()
    middleware = GuardMiddleware(app, guard)

    async def main():
        opened = [await _call(middleware, path, "GET") for path in ("/health", "/ready", "/metrics",
                                                                      "/openapi.json")]
        refused = [await _call(middleware), await _call(middleware, key="sk-wrong"),
                   await _call(middleware, headers={"authorization": KEY}),           # no Bearer scheme
                   await _call(middleware, "/v1/models", "GET")]
        admitted = await _call(middleware, key=KEY)
        return opened, refused, admitted

    opened, refused, admitted = asyncio.run(main())
    assert [r.status for r in opened] == [200] * 4
    for reply in refused:
        assert reply.status == 401 and reply.error()["code"] == "invalid_api_key"
        assert reply.headers["www-authenticate"] == "Bearer"
        assert KEY not in reply.body.decode()
    assert admitted.status == 200
    assert app.paths == ["/health", "/ready", "/metrics", "/openapi.json", "/v1/completions"]
    assert rejected("http", "auth") == 4


def test_concurrency_is_per_key_and_the_slot_comes_back():
    guard, rejected = counted_guard((KEY, OTHER_KEY), max_concurrent_per_key=1)
    app = RecordingApp()
    middleware = GuardMiddleware(app, guard)

    async def main():
        held = asyncio.create_task(_call(middleware, "/v1/hold", key=KEY))
        await async_wait_until(lambda: "/v1/hold" in app.paths, timeout=5, interval=0,
                               what="the app to hold the first request")
        same_key = await _call(middleware, key=KEY, client="10.0.0.2")    # a key is a client, wherever it is
        other_key = await _call(middleware, key=OTHER_KEY)
        listing = await _call(middleware, "/v1/models", "GET", key=KEY)  # only generation is limited
        app.release.set()
        first = await held
        again = await _call(middleware, key=KEY)
        return same_key, other_key, listing, first, again

    same_key, other_key, listing, first, again = asyncio.run(main())
    assert same_key.status == 429 and same_key.error()["code"] == "concurrency"
    assert same_key.headers["retry-after"] == "1"
    assert (other_key.status, listing.status, first.status, again.status) == (200, 200, 200, 200)
    assert rejected("http", "concurrency") == 1
    assert guard.limiter.num_in_flight() == 0                 # leak check


def test_without_keys_the_client_is_the_peer_address():
    guard, rejected = counted_guard(max_concurrent_per_key=1)
    app = RecordingApp()
    middleware = GuardMiddleware(app, guard)

    async def main():
        held = asyncio.create_task(_call(middleware, "/v1/hold", client="10.0.0.1"))
        await async_wait_until(lambda: "/v1/hold" in app.paths, timeout=5, interval=0,
                               what="the app to hold the first request")
        same, other = await _call(middleware, client="10.0.0.1"), await _call(middleware, client="10.0.0.2")
        app.release.set()
        await held
        return same, other

    same, other = asyncio.run(main())
    assert (same.status, other.status) == (429, 200)
    assert guard.limiter.num_in_flight() == 0


def test_the_rate_limit_refills_on_the_injected_clock():
    clock = FakeClock(100.0)
    guard, rejected = counted_guard(clock=clock, rate_limit=1.0, rate_limit_burst=1, max_concurrent_per_key=0)
    middleware = GuardMiddleware(RecordingApp(), guard)

    async def main():
        first, second = await _call(middleware), await _call(middleware)
        clock.advance(0.5)
        too_soon = await _call(middleware)
        clock.advance(0.5)
        return first, second, too_soon, await _call(middleware)

    first, second, too_soon, refilled = asyncio.run(main())
    assert first.status == 200 and refilled.status == 200
    for reply in (second, too_soon):
        assert reply.status == 429 and reply.error()["code"] == "rate_limit"
        assert reply.error()["type"] == "rate_limit_error" and reply.headers["retry-after"] == "1"
    assert rejected("http", "rate_limit") == 2


def test_a_body_over_the_limit_is_413_before_the_app_sees_it():
    guard, rejected = counted_guard(max_body_bytes=16)
    app = RecordingApp()
    middleware = GuardMiddleware(app, guard)

    async def main():
        declared = await _call(middleware, chunks=(b"x" * 100,), headers={"content-length": "100"})
        streamed = await _call(middleware, chunks=(b"x" * 10, b"y" * 10, b"z" * 10))      # no content-length
        fits = await _call(middleware, chunks=(b'{"a":', b" 1234}"))
        return declared, streamed, fits

    declared, streamed, fits = asyncio.run(main())
    for reply in (declared, streamed):
        assert reply.status == 413 and reply.error()["code"] == "request_too_large"
        assert reply.headers["connection"] == "close" and "16 bytes" in reply.error()["message"]
    assert fits.status == 200 and app.bodies == [b'{"a": 1234}']   # joined, then replayed whole
    assert rejected("http", "body_too_large") == 2


def test_tokenization_is_bounded_like_generation():
    guard, rejected = counted_guard(max_body_bytes=16)
    app = RecordingApp()
    middleware = GuardMiddleware(app, guard)

    async def main():
        return [await _call(middleware, path, chunks=(b"x" * 100,)) for path in ("/tokenize", "/detokenize")]

    assert [reply.status for reply in asyncio.run(main())] == [413, 413]
    assert app.paths == [] and rejected("http", "body_too_large") == 2


def test_a_4xx_from_the_app_is_counted_as_invalid():
    guard, rejected = counted_guard()
    middleware = GuardMiddleware(RecordingApp(status=400), guard)
    reply = asyncio.run(_call(middleware))
    assert reply.status == 400 and orjson.loads(reply.body) == {"read": 2}     # passed through unchanged
    assert rejected("http", "invalid") == 1


@pytest.mark.parametrize("path", ["/v1/never", "/v1/never-streamed", "/v1/never-whole"])
def test_a_request_past_its_timeout_is_cancelled_and_answered(path):
    # A timeout this short has passed by the time the app first waits: no real time goes by.
    guard, rejected = counted_guard(request_timeout_s=1e-9)
    app = RecordingApp()
    reply = asyncio.run(_call(GuardMiddleware(app, guard), path))
    assert app.cancelled == [path]
    last = reply.messages[-1]
    assert last["type"] == "http.response.body" and not last.get("more_body", False)
    if path == "/v1/never":                       # nothing sent yet: a 504
        assert reply.status == 504
        assert reply.error()["type"] == "timeout" and reply.error()["code"] == "request_timeout"
    elif path == "/v1/never-streamed":            # mid-stream: an in-band error event, then [DONE]
        assert reply.status == 200 and last["body"].endswith(DONE)
        assert orjson.loads(last["body"].removesuffix(DONE).removeprefix(b"data: "))["error"]["code"] == \
            "request_timeout"
    else:                                         # a whole response already begun: it just ends
        assert reply.status == 200 and last["body"] == b""
    assert rejected("http", "timeout") == 1
    assert guard.limiter.num_in_flight() == 0
