"""A tiny OpenAI-style streaming server with injected delays and failures (test helper).

Run as a script: it listens on a free 127.0.0.1 port, prints `listening on PORT`
and serves until terminated. What it does is chosen by the first word of the
prompt (or of the last chat message):

- `delay-<ttft ms>-<itl ms>-<tokens>`: headers at once, the first token after
  ttft, then one token every itl, scheduled on absolute times so that sleep
  overshoot does not accumulate, then a usage chunk and [DONE];
- `status-<code>`: an OpenAI error body with that HTTP status;
- `drop`: one token, then the connection is cut mid-stream;
- `hangup`: the connection is closed before any response.

GET requests (a client's warm-up of /v1/models) get an empty model list.
"""

from __future__ import annotations

import asyncio
import json
import re
import time


def _chunk(payload: str) -> bytes:
    data = f"data: {payload}\n\n".encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _event(text: str | None = None, usage: dict | None = None) -> str:
    choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": None}]
    return json.dumps({"object": "text_completion", "choices": choices, "usage": usage})


async def _read_request(reader: asyncio.StreamReader) -> dict | None:
    """The JSON body of a POST; None for a GET."""
    head = await reader.readuntil(b"\r\n\r\n")
    if head.startswith(b"GET "):
        return None
    length = int(re.search(rb"content-length:\s*(\d+)", head, re.I).group(1))
    return json.loads(await reader.readexactly(length))


def _json_response(status: int, obj: dict) -> bytes:
    data = json.dumps(obj).encode()
    return (f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\nconnection: close\r\n\r\n").encode() + data


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        body = await _read_request(reader)
        t0 = time.perf_counter()
        if body is None:
            writer.write(_json_response(200, {"object": "list", "data": []}))
            await writer.drain()
            return
        prompt = body.get("prompt") or body["messages"][-1]["content"]
        word = prompt.split()[0]
        if word == "hangup":
            return
        if word.startswith("status-"):
            status = int(word.split("-")[1])
            writer.write(_json_response(status, {"error": {"message": f"injected {status}", "type": "test"}}))
            await writer.drain()
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
        await writer.drain()
        ttft_ms, itl_ms, n = (300, 40, 4) if word == "drop" else map(int, word.split("-")[1:])
        for k in range(n):
            await asyncio.sleep(max(0.0, t0 + (ttft_ms + k * itl_ms) / 1000 - time.perf_counter()))
            writer.write(_chunk(_event(f" t{k}")))
            await writer.drain()
            if word == "drop":
                writer.transport.abort()
                return
        usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
        writer.write(_chunk(_event(usage=usage)) + _chunk("[DONE]") + b"0\r\n\r\n")
        await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def main() -> None:
    server = await asyncio.start_server(_handle, "127.0.0.1", 0)
    print(f"listening on {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
