"""One streamed OpenAI request → one `RequestRecord`.

`Target` says where and how to send: the base URL (with or without `/v1`), the
model name, the API (`completions` or `chat`) and, for completions, whether the
prompt goes as text (any OpenAI server) or as token ids (exact by construction;
splitserve and vLLM accept it). Requests always stream with
`stream_options.include_usage`, so output tokens come from the server's usage;
when a server sends no usage they are counted with the tokenizer.

`build_request` assembles a turn's prompt (earlier turns and answers first, for
multi-turn sessions) and counts its tokens as the server will (BOS for text, the
chat template for chat). `stream_request` never raises for what a server does:
HTTP errors, dropped connections, in-band error events and timeouts become the
record's `error_kind`; only cancellation propagates.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from splitserve.loadgen import metrics
from splitserve.loadgen.recorder import CANCELLED, RequestRecord
from splitserve.loadgen.tokens import PromptVocab

MAX_ERROR_BODY = 2000


@dataclass(slots=True)
class Target:
    url: str
    model: str
    api: str = "completions"          # completions | chat
    prompt_format: str = "text"       # text | ids (completions only)
    ignore_eos: bool = True           # vLLM-style extension: makes output lengths exact
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)

    @property
    def base(self) -> str:
        url = self.url.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"

    def describe(self) -> dict:
        return {"url": self.url, "model": self.model, "api": self.api, "prompt_format": self.prompt_format,
                "ignore_eos": self.ignore_eos, "temperature": self.temperature}


@dataclass(slots=True)
class PreparedRequest:
    path: str
    body: dict
    num_prompt_tokens: int | None


def build_request(target: Target, vocab: PromptVocab, history: list[tuple[str, str]], text: str,
                  max_tokens: int) -> PreparedRequest:
    """The request for a turn with user `text` after `history` [(user, answer), ...]."""
    tok = vocab.tokenizer
    common = {"model": target.model, "max_tokens": max_tokens, "temperature": target.temperature,
              "stream": True, "stream_options": {"include_usage": True}}
    if target.ignore_eos:
        common["ignore_eos"] = True
    if target.api == "chat":
        messages = []
        for user, answer in history:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": text})
        count = len(tok.apply_chat_template(messages)) if tok.chat_template else None
        return PreparedRequest("/chat/completions", {**common, "messages": messages, **target.extra_body}, count)
    parts = [part for user, answer in history for part in (user, answer.strip())] + [text]
    prompt = " ".join(part for part in parts if part)
    if target.prompt_format == "ids":
        ids = tok.encode(prompt, add_special_tokens=False)
        return PreparedRequest("/completions", {**common, "prompt": ids, **target.extra_body}, len(ids))
    return PreparedRequest("/completions", {**common, "prompt": prompt, **target.extra_body},
                           vocab.count(prompt, add_special_tokens=True))


def _content(obj: dict) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def stream_request(http: httpx.AsyncClient, target: Target, prepared: PreparedRequest,
                         record: RequestRecord, clock, timeout_s: float, vocab: PromptVocab | None) -> None:
    """Send `prepared`, fill `record` (start/end, chunks, usage, errors). `clock()` gives run time."""
    record.start_s = clock()
    try:
        async with asyncio.timeout(timeout_s):
            await _stream(http, target, prepared, record, clock)
    except TimeoutError:
        record.fail("timeout", f"no complete response within {timeout_s:g} s")
    except asyncio.CancelledError:
        record.fail(CANCELLED, "the run ended before the response did")
        raise
    except httpx.ConnectError as exc:
        record.fail("connect", f"cannot connect: {exc}")
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        record.fail("disconnected", f"connection dropped: {exc!r}")
    except httpx.TimeoutException as exc:
        record.fail("timeout", f"{type(exc).__name__}: {exc}")
    except (json.JSONDecodeError, TypeError, AttributeError) as exc:
        record.fail("bad_response", f"unparseable stream: {exc}")
    except Exception as exc:            # never let one request take the run down
        record.fail("client_error", f"{type(exc).__name__}: {exc}")
    finally:
        record.end_s = clock()
        if record.ok and record.output_tokens is None:
            _count_output(record, vocab)
        metrics.finish_record(record)


async def _stream(http: httpx.AsyncClient, target: Target, prepared: PreparedRequest,
                  record: RequestRecord, clock) -> None:
    async with http.stream("POST", target.base + prepared.path, json=prepared.body) as response:
        record.status_code = response.status_code
        if response.status_code >= 400:
            body = (await response.aread())[:MAX_ERROR_BODY].decode("utf-8", "replace")
            record.fail(f"http_{response.status_code}", _error_message(body))
            return
        parts, done = [], False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            obj = json.loads(payload)
            if obj.get("error"):
                record.fail("stream_error", _error_message(json.dumps(obj)))
                return
            text = _content(obj)
            if text:
                record.chunk_times_s.append(clock() - record.start_s)
                parts.append(text)
            usage = obj.get("usage")
            if usage:
                record.prompt_tokens = usage.get("prompt_tokens")
                record.output_tokens = usage.get("completion_tokens")
                record.output_tokens_source = "usage"
                record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        record.output_text = "".join(parts)
        if not done:
            record.fail("incomplete", "the stream ended without [DONE]")
            return
        record.ok = True


def _count_output(record: RequestRecord, vocab: PromptVocab | None) -> None:
    if vocab is not None:
        record.output_tokens = vocab.count(record.output_text) if record.output_text else 0
        record.output_tokens_source = "tokenizer"


def _error_message(body: str) -> str:
    try:
        obj = json.loads(body)
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    except json.JSONDecodeError:
        pass
    return body.strip() or "(empty body)"


def make_http_client(max_connections: int | None = None, connect_timeout_s: float = 10.0,
                     transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """An HTTP/1.1 client with no connection cap by default (open-loop runs need many at once).
    `transport` replaces the network (tests pass an `httpx.MockTransport`)."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=connect_timeout_s), limits=limits,
                             trust_env=False, transport=transport)


async def warm_up(http: httpx.AsyncClient, target: Target) -> None:
    """One GET of /models before the clock starts: the first request on a fresh client
    pays for lazy imports and setup (tens of ms) that would otherwise land in its TTFT.
    Its outcome does not matter; an unreachable server shows in the records."""
    try:
        await http.get(target.base + "/models", timeout=5.0)
    except httpx.HTTPError:
        pass


def monotonic_clock(t0: float | None = None):
    start = time.perf_counter() if t0 is None else t0
    return lambda: time.perf_counter() - start
