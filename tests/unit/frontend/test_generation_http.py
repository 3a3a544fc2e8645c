"""The generation endpoints' ASGI plumbing: body reading, disconnect watching, error responses.

Driven through in-memory ASGI receive/send channels; the HTTP behaviour end to end
(real uvicorn, real workers) is in tests/integration/serving and tests/integration/faults.
"""

from __future__ import annotations

import asyncio

import orjson

from splitserve.services.frontend.errors import APIError
from splitserve.services.frontend.http.generation import DONE, DisconnectWatcher, Response, read_body


class Channel:
    """An ASGI receive fed from a queue, and a send that records messages."""

    def __init__(self, *incoming: dict):
        self.incoming: asyncio.Queue = asyncio.Queue()
        for message in incoming:
            self.incoming.put_nowait(message)
        self.sent: list[dict] = []
        self.receiving = asyncio.Event()         # someone waits in receive(): a step to wait for

    async def receive(self) -> dict:
        self.receiving.set()
        return await self.incoming.get()

    async def send(self, message: dict) -> None:
        self.sent.append(message)


def test_read_body_joins_chunks_and_sees_a_disconnect():
    async def run():
        parts = Channel({"type": "http.request", "body": b'{"a":', "more_body": True},
                        {"type": "http.request", "body": b" 1}", "more_body": False})
        gone = Channel({"type": "http.request", "body": b"{", "more_body": True}, {"type": "http.disconnect"})
        return await read_body(parts.receive), await read_body(gone.receive)

    assert asyncio.run(run()) == (b'{"a": 1}', None)


def test_a_disconnect_cancels_the_request_and_is_told_apart():
    async def request(channel: Channel) -> tuple[bool, bool]:
        watcher = DisconnectWatcher(channel.receive)
        try:
            await asyncio.Event().wait()          # a request that runs until it is cancelled
            return False, watcher.disconnected
        except asyncio.CancelledError:
            asyncio.current_task().uncancel()
            return True, watcher.disconnected
        finally:
            watcher.stop()

    async def run():
        channel = Channel()
        task = asyncio.create_task(request(channel))
        await channel.receiving.wait()            # the watcher reads the connection now
        channel.incoming.put_nowait({"type": "http.disconnect"})
        return await asyncio.wait_for(task, 2)

    assert asyncio.run(run()) == (True, True)


def test_stopping_the_watcher_before_the_disconnect_leaves_the_request_alone():
    async def run():
        channel = Channel()
        watcher = DisconnectWatcher(channel.receive)
        watcher.stop()
        channel.incoming.put_nowait({"type": "http.disconnect"})   # what a server reports after the response
        for _ in range(5):                        # a watcher still running would read it in one turn
            await asyncio.sleep(0)
        return watcher.disconnected

    assert asyncio.run(run()) is False


def test_failures_before_and_after_the_response_starts():
    error = APIError(503, "no worker", type="service_unavailable")

    async def run():
        before, after = Channel(), Channel()
        await Response(before.send, "cmpl-1").fail(error)
        streaming = Response(after.send, "cmpl-2")
        await streaming.start(200, [(b"content-type", b"text/event-stream")])
        await streaming.fail(error)
        return before.sent, after.sent

    before, after = asyncio.run(run())
    start, body = before
    assert start["status"] == 503 and (b"x-request-id", b"cmpl-1") in start["headers"]
    assert orjson.loads(body["body"]) == error.body() and body["more_body"] is False
    assert after[0]["status"] == 200 and (b"x-request-id", b"cmpl-2") in after[0]["headers"]
    assert after[1]["body"] == b"data: " + orjson.dumps(error.body()) + b"\n\n" + DONE
    assert after[1]["more_body"] is False
