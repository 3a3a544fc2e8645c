"""ASGI plumbing shared by the guard and the generation routes: the callable types, JSON
responses and server-sent events."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

DONE = b"data: [DONE]\n\n"

# Characters JSON may leave raw that line splitters such as str.splitlines (httpx's
# aiter_lines) take for line breaks, cutting an event in two; escaped, the text is the same.
_LINE_BREAKS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))


def event(payload: dict) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    data = orjson.dumps(payload)
    for raw, escaped in _LINE_BREAKS:
        data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


async def send_json(send: Send, status: int, payload: dict,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = orjson.dumps(payload)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                            *(headers or ())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
