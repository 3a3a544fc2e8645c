"""POST /v1/completions and /v1/chat/completions as plain ASGI, in front of the FastAPI app.

These two endpoints are the request path; everything else (models, health,
metrics, the OpenAPI document, error handlers for unknown routes) stays in
FastAPI. Going through FastAPI's router, dependency solver, exception
middlewares and Starlette's StreamingResponse (a task group per response)
cost about a millisecond of the frontend's added latency per request
(bench/serving.py); here a request is: read the body, parse and validate it,
prime the worker stream, then one `send` per worker message.

Priming: the worker's first message (or its refusal) arrives before any byte
of the response is sent, so a streamed request that the worker rejects still
gets a proper 4xx instead of a 200 that breaks off. From the end of the body
to the end of the response one watcher task reads the connection: when the
client disconnects it cancels the request, which cancels the worker call
(core.py), streaming or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import orjson
from pydantic import BaseModel, ValidationError

from splitserve.services.flow_control import FlowRequest
from splitserve.tracing import TraceContext

from splitserve.services.frontend import metrics as m
from splitserve.services.frontend.asgi import DONE, Receive, Scope, Send, event, send_json
from splitserve.services.frontend.errors import APIError, from_validation_error, invalid
from splitserve.services.frontend.beam_search import BeamSearchParams, beam_deltas, eos_token_id, search_prompts
from splitserve.services.frontend.core import Delta, Frontend, SamplingRequest, new_request_id
from splitserve.services.frontend.flow_headers import check_priority, flow_request
from splitserve.services.frontend.gateway import gateway_prefill_address
from splitserve.services.frontend.generation_request import GenerationRequest
from splitserve.services.frontend.guard import KEY_ID_SCOPE
from splitserve.services.frontend.limits import PromptBound, check_prompt_tokens
from splitserve.services.frontend.http.beam_search_api import beam_search_params
from splitserve.services.frontend.http.protocol import ALL_LOGPROBS, ChatCompletionRequest, CompletionRequest
from splitserve.services.frontend.http.responses import (ChatFormatter, CompletionFormatter, best_samples, merge_full,
                                                         merged_usage)
from splitserve.services.frontend.http.structured import requested_structure
from splitserve.services.frontend.tools.choice import template_message, tool_setup

log = logging.getLogger(__name__)

# vLLM's answer to an /invocations body that is no request it serves (its words and its list).
NO_INVOCATION_HANDLER = ("Cannot find suitable handler for request. Expected one of: "
                         "['ChatCompletionRequest', 'CompletionRequest']")
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


@dataclass(slots=True)
class Choice:
    """One choice of a response: its worker request and the formatter of its output."""

    gen: GenerationRequest
    formatter: ChatFormatter | CompletionFormatter
    first_of_prompt: bool = True     # counts its prompt's tokens in the usage


@dataclass(slots=True)
class Prepared:
    """A parsed, validated request, ready to generate: one choice, or n per prompt."""

    choices: list[Choice]
    stream: bool
    keep_best: int = 0    # best_of > n: of each prompt's samples, return the n (this) most likely
    beam: BeamSearchParams | None = None     # use_beam_search: each prompt's first choice is the search
    priority: int = 0     # vLLM's request priority (lower first): flow control's band (flow_admission.py)

    @property
    def gen(self) -> GenerationRequest:
        return self.choices[0].gen

    @property
    def formatter(self) -> ChatFormatter | CompletionFormatter:
        return self.choices[0].formatter


class GenerationEndpoints:
    """ASGI middleware: serves the generation routes itself, passes everything else on."""

    def __init__(self, app, frontend: Frontend, max_prompt_tokens: int = 0):
        self.app = app
        self.frontend = frontend
        self.max_prompt_tokens = max_prompt_tokens
        self.bound = PromptBound.of(frontend.tokenizer)
        self.routes: dict[str, Callable[[bytes], Prepared]] = {
            "/v1/completions": self.prepare_completion, "/v1/chat/completions": self.prepare_chat,
            "/invocations": self.prepare_invocation}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        prepare = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if prepare is None:
            await self.app(scope, receive, send)
        elif scope["method"] != "POST":
            await send_json(send, 405, APIError(405, "Method Not Allowed").body(), [(b"allow", b"POST")])
        else:
            await self._serve(prepare, scope, receive, send)

    # -- parsing ---------------------------------------------------------------------
    def prepare_completion(self, raw: bytes) -> Prepared:
        body = self._parse(raw, CompletionRequest, "completions")
        choices: list[Choice] = []
        request_id = _response_id("cmpl", body)
        structured = self._refusing("completions", lambda: requested_structure(body))
        for p, prompt in enumerate(body.prompts()):
            if isinstance(prompt, str):
                self._check_length("completions", len(prompt), "prompt")
            prompt_ids = self._refusing("completions",
                                        lambda: self.frontend.text_prompt(prompt, body.add_special_tokens))
            prompt_ids = _truncated(prompt_ids, body)
            echo = _echo_text(body, prompt, prompt_ids, self.frontend.tokenizer)
            ranked = body.num_samples > body.num_choices
            for j in range(body.num_samples):
                index = p * body.num_samples + j      # best_of > n: renumbered once ranked
                # Ranking needs each sampled token's logprob, which the response shows only if asked.
                logprobs = 0 if (ranked and body.logprobs is None) or body.logprob_token_ids else body.logprobs
                sampling = SamplingRequest(max_tokens=body.max_tokens, default_max_tokens=16,
                                           logprobs=logprobs, structured=structured,
                                           **_sampling_fields(body, j))
                gen = self._prepare("completions", _worker_id(request_id, body), prompt_ids, sampling, "prompt",
                                    index)
                fmt = CompletionFormatter(request_id, self.frontend.model_name, self.frontend.tokenizer, body,
                                          prompt_ids, index, echo)
                choices.append(Choice(gen, fmt, first_of_prompt=j == 0))
        beam = beam_search_params(body, choices[0].gen.params.max_tokens, body.logprobs or 0,
                                  self.frontend.max_logprobs) \
            if body.use_beam_search else None
        return Prepared(choices, body.stream, body.num_choices if ranked else 0, beam, body.priority)

    def prepare_chat(self, raw: bytes) -> Prepared:
        body = self._parse(raw, ChatCompletionRequest, "chat")
        tools, forced = self._refusing("chat", lambda: tool_setup(body, self.frontend.tool_parser))
        messages = [template_message(msg) for msg in body.messages]
        self._check_length("chat", sum(len(msg["content"]) for msg in messages), "messages")
        variables = {**(body.chat_template_kwargs or {}),
                     **({"documents": body.documents} if body.documents is not None else {}),
                     **({"reasoning_effort": body.reasoning_effort} if body.reasoning_effort else {}),
                     **(tools.template_variables() if tools else {})}
        prompt_ids = self._refusing("chat", lambda: self.frontend.chat_prompt(
            messages, add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, add_special_tokens=body.add_special_tokens,
            variables=variables))
        prompt_ids = _truncated(prompt_ids, body)
        # echo: the reply starts with the last message when it is the assistant's (vLLM's rule).
        echo = messages[-1]["content"] if body.echo and messages[-1]["role"] == "assistant" else ""
        request_id = _response_id("chatcmpl", body)
        structured = self._refusing("chat", lambda: requested_structure(body))
        structured = forced or structured     # tool_choice required / named: over response_format (vLLM)
        choices = []
        for j in range(body.num_choices):
            sampling = SamplingRequest(
                max_tokens=body.requested_max_tokens(), default_max_tokens=None,
                max_tokens_param="max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
                logprobs=0 if body.logprob_token_ids else body.num_logprobs(), logprobs_param="top_logprobs",
                structured=structured, **_sampling_fields(body, j))
            gen = self._prepare("chat", _worker_id(request_id, body), prompt_ids, sampling, "messages", j)
            choices.append(Choice(gen, ChatFormatter(request_id, self.frontend.model_name, self.frontend.tokenizer,
                                                     body, prompt_ids, j, echo, tools.output() if tools else None),
                                  first_of_prompt=j == 0))
        beam = beam_search_params(body, choices[0].gen.params.max_tokens, body.num_logprobs() or 0,
                                  self.frontend.max_logprobs) \
            if body.use_beam_search else None
        return Prepared(choices, body.stream, beam=beam, priority=body.priority)

    def prepare_invocation(self, raw: bytes) -> Prepared:
        """vLLM's SageMaker route, POST /invocations: the body's shape picks the endpoint, chat
        (`messages`) before completions (`prompt`), as vLLM tries them; a body of neither shape (an
        embedding's `input`...) gets vLLM's 400 naming the shapes served. A body of one shape that
        the endpoint refuses gets that endpoint's own 400 (vLLM's says only "no handler")."""
        try:
            data = loads_body(raw)
        except ValueError as exc:
            raise invalid(f"malformed JSON body: {str(exc)[:200]}", None, "invalid_json") from None
        if isinstance(data, dict) and "messages" in data:
            return self.prepare_chat(raw)
        if isinstance(data, dict) and "prompt" in data:
            return self.prepare_completion(raw)
        raise invalid(NO_INVOCATION_HANDLER, None, "invalid_request")

    def _parse(self, raw: bytes, model: type[BaseModel], api: str):
        def parse():
            body = parse_body(raw, model)
            check_priority(getattr(body, "priority", 0), self.frontend.flow_control is not None)
            self.frontend.check_model(body.model)
            return body
        return self._refusing(api, parse)

    def _check_length(self, api: str, num_chars: int, param: str) -> None:
        """Before tokenizing: a text that cannot fit is refused without spending CPU on it."""
        limit = self.max_prompt_tokens or self.frontend.max_model_len
        self._refusing(api, lambda: self.bound.check(num_chars, limit, param))

    def _prepare(self, api: str, request_id: str, prompt_ids: list[int], sampling: SamplingRequest,
                 param: str, index: int = 0) -> GenerationRequest:
        """The worker request of choice `index` (its id: the response's, then `-<index>` past the first)."""
        self._refusing(api, lambda: check_prompt_tokens(len(prompt_ids), self.max_prompt_tokens, param))
        params = self._refusing(api, lambda: self.frontend.sampling_params(sampling, len(prompt_ids)))
        return GenerationRequest(request_id if index == 0 else f"{request_id}-{index}", api, prompt_ids, params,
                                 skip_special_tokens=sampling.skip_special_tokens,
                                 max_tokens_from_client=sampling.caps_output)

    def _refusing(self, api: str, fn):
        """fn(); a refusal is counted in the requests metric (the lifecycle counts the rest)."""
        try:
            return fn()
        except APIError as exc:
            self.frontend.metrics.requests.labels(
                api, m.STATUS_INVALID if exc.status < 500 else m.STATUS_UNAVAILABLE).inc()
            raise

    # -- serving ---------------------------------------------------------------------
    async def _serve(self, prepare: Callable[[bytes], Prepared], scope: Scope, receive: Receive,
                     send: Send) -> None:
        raw = await read_body(receive)
        if raw is None:
            return                      # the client left before the body was complete
        try:
            req = prepare(raw)
            flow = self._flow_request(scope, req)
        except APIError as error:
            await send_json(send, error.status, error.body())
            return
        if self.frontend.tracer is not None:          # the client's W3C traceparent, if it sent one
            context = TraceContext.from_pairs(scope["headers"])
            for choice in req.choices:
                choice.gen.trace_context = context
        if self.frontend.gateway:
            try:
                prefill_address = gateway_prefill_address(scope["headers"])
            except APIError as error:
                await send_json(send, error.status, error.body())
                return
            for choice in req.choices:
                choice.gen.prefill_address = prefill_address
        watcher = DisconnectWatcher(receive)
        response = Response(send, req.gen.request_id)
        try:
            async with self._admitted(flow, response) as admitted:
                if admitted:
                    await self._generate(req, response)
        except asyncio.CancelledError:
            if not watcher.disconnected:
                raise                   # the request timeout or shutdown: the guard answers
            asyncio.current_task().uncancel()
        except Exception:
            log.exception("request %s: unhandled error", req.gen.request_id)
            await response.fail(APIError(500, "internal error while generating", type="server_error"))
        finally:
            watcher.stop()

    def _flow_request(self, scope: Scope, req: Prepared) -> FlowRequest | None:
        """What flow control needs of the request (None when it is off); a bad header is a 400."""
        if self.frontend.flow_control is None:
            return None
        return flow_request(scope["headers"], req.priority, scope.get(KEY_ID_SCOPE), req.gen.request_id)

    @contextlib.asynccontextmanager
    async def _admitted(self, flow: FlowRequest | None, response: "Response") -> AsyncIterator[bool]:
        """Flow control's admission before any routing (True: go on), its ticket held until the
        request ends however it ends; False after answering a shed request's 429."""
        if flow is None:
            yield True
            return
        try:
            ticket = await self.frontend.flow_control.admit(flow)
        except APIError as shed:
            await response.fail(shed)
            yield False
            return
        with ticket:
            yield True

    async def _generate(self, req: Prepared, response: "Response") -> None:
        if req.beam is not None:
            await self._generate_beams(req, response)
            return
        if len(req.choices) > 1:
            await self._generate_choices(req, response)
            return
        deltas = self.frontend.generate(req.gen)
        try:
            if (first := await _primed(response, anext(deltas))) is None:
                return
            if req.stream:
                await response.start(200, _SSE_HEADERS)
                async for chunk in sse(req.formatter, first, deltas):
                    await response.body(chunk, last=chunk.endswith(DONE))
            else:
                await response.whole(await collect(req.formatter, first, deltas))
        finally:
            await deltas.aclose()

    async def _generate_choices(self, req: Prepared, response: "Response") -> None:
        """Several choices (n > 1, a list of prompts): the n choices of each prompt are one worker
        request (forks.py: one prefill, shared KV blocks), prompts run concurrently; a stream
        interleaves the choices' chunks as they come, each with its choice's index."""
        streams, calls = [], []
        for group in _by_prompt(req.choices):
            group_streams, call = self.frontend.generate_forked([c.gen for c in group])
            streams.extend(group_streams)
            calls.extend([call] if call is not None else [])
        try:
            primes = [asyncio.ensure_future(anext(s)) for s in streams]
            if (firsts := await _primed(response, asyncio.gather(*primes))) is None:
                # One choice was refused: stop the others' first reads before their streams close.
                for p in primes:
                    p.cancel()
                await asyncio.gather(*primes, return_exceptions=True)
                return
            if not req.stream:
                collected = await asyncio.gather(*(collect_deltas(f, s) for f, s in zip(firsts, streams)))
                choices, first_of_prompt = req.choices, [c.first_of_prompt for c in req.choices]
                if req.keep_best:
                    kept = best_samples([d for d in collected], first_of_prompt, req.keep_best)
                    choices, collected = [choices[i] for i in kept], [collected[i] for i in kept]
                    for rank, c in enumerate(choices):
                        c.formatter.index = rank
                    first_of_prompt = [rank % req.keep_best == 0 for rank in range(len(choices))]
                bodies = [c.formatter.full(d) for c, d in zip(choices, collected)]
                usage = merged_usage([d[-1] for d in collected], first_of_prompt)
                await response.whole(merge_full(bodies, usage))
                return
            await response.start(200, _SSE_HEADERS)
            # aclosing: a client leaving mid-stream stops the pumps before the streams are closed.
            async with contextlib.aclosing(sse_choices(req, firsts, streams)) as chunks:
                async for chunk in chunks:
                    await response.body(chunk, last=chunk.endswith(DONE))
        finally:
            for s in streams:
                await s.aclose()
            for call in calls:
                call.close()

    async def _generate_beams(self, req: Prepared, response: "Response") -> None:
        """use_beam_search: one beam search per prompt (beam_search.py), its beams the prompt's
        choices, best first; a whole body, or (chat) the role chunks, then each beam's one chunk."""
        groups = _by_prompt(req.choices)
        tokenizer = self.frontend.tokenizer
        try:
            results = await search_prompts(self.frontend.generate, [g[0].gen for g in groups], req.beam,
                                           eos_token_id(tokenizer))
        except APIError as error:
            await response.fail(error)
            return
        choices, deltas = [], []
        for group, result in zip(groups, results):
            beams = beam_deltas(result, tokenizer, group[0].gen.skip_special_tokens)
            choices += group[:len(beams)]
            deltas += beams
        first_of_prompt = [c.first_of_prompt for c in choices]
        usage = merged_usage(deltas, first_of_prompt)
        if not req.stream:
            await response.whole(merge_full([c.formatter.full([d]) for c, d in zip(choices, deltas)], usage))
            return
        await response.start(200, _SSE_HEADERS)
        chunks = [chunk for c in choices for chunk in c.formatter.opening()]
        chunks += [chunk for c, d in zip(choices, deltas) for chunk in c.formatter.chunks(d)]
        if choices[0].formatter.include_usage:
            chunks.append(choices[0].formatter.usage_chunk(usage))
        await response.body(b"".join(event(chunk) for chunk in chunks) + DONE, last=True)


def _by_prompt(choices: list[Choice]) -> list[list[Choice]]:
    """The choices in runs of one prompt each (its n choices follow its first)."""
    groups: list[list[Choice]] = []
    for c in choices:
        if c.first_of_prompt or not groups:
            groups.append([c])
        else:
            groups[-1].append(c)
    return groups


async def _primed(response: "Response", first):
    """The worker's first message (or every choice's): awaited before any byte of the answer, so
    that a refusal is still a proper 4xx; None once that refusal (or an empty stream's 502) is sent."""
    try:
        return await first
    except APIError as error:
        await response.fail(error)
    except StopAsyncIteration:
        await response.fail(APIError(502, "the worker ended the stream early", type="server_error"))
    return None


class Response:
    """The ASGI send side of one generation response, with the request id header."""

    def __init__(self, send: Send, request_id: str):
        self._send = send
        self._request_id = request_id.encode()
        self.started = False

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        await self._send({"type": "http.response.start", "status": status,
                          "headers": [*headers, (b"x-request-id", self._request_id)]})

    async def body(self, data: bytes, last: bool) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": not last})

    async def whole(self, document: dict) -> None:
        """A 200 with the whole JSON body."""
        payload = orjson.dumps(document)
        await self.start(200, [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))])
        await self.body(payload, last=True)

    async def fail(self, error: APIError) -> None:
        """The error as a JSON response, or in-band when the stream has begun (as OpenAI does)."""
        if not self.started:
            await send_json(self._send, error.status, error.body(),
                            [(b"x-request-id", self._request_id), *error.header_pairs()])
        else:
            await self.body(event(error.body()) + DONE, last=True)


class DisconnectWatcher:
    """Reads the connection until the client disconnects, then cancels the request's task."""

    def __init__(self, receive: Receive):
        self.disconnected = False
        self._request = asyncio.current_task()
        self._task = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        self._request.cancel()

    def stop(self) -> None:
        # Runs before the watcher can see the disconnect that the server reports once the
        # response is complete: the request's task does not yield between its last send and here.
        self._task.cancel()


async def read_body(receive: Receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def parse_body(raw: bytes, model: type[BaseModel]):
    try:
        data = loads_body(raw)
    except ValueError as exc:
        raise invalid(f"malformed JSON body: {str(exc)[:200]}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_json")
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    for param, message in body.unsupported_values():
        raise invalid(message, param, "unsupported_parameter")
    return body


def loads_body(raw: bytes):
    """Parse a JSON body; ValueError for anything that is not JSON or holds text no tokenizer takes.

    orjson first: it refuses invalid UTF-8, lone surrogates and nesting beyond 1024 levels
    outright. What it refuses but Python's json reads — NaN, Infinity, integers beyond 64
    bits — is parsed again so that the schema check names the offending field (a NaN
    temperature is an invalid temperature), as no string holds a lone surrogate.
    """
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as strict_error:
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            raise strict_error from None
    pending = [data]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, str):
            item.encode("utf-8")          # UnicodeEncodeError (a ValueError) on a lone surrogate
    return data


def _sampling_fields(body, choice: int = 0) -> dict:
    """The request's sampling fields for its choice `choice`: a seeded request's choices get
    seed, seed+1, ... so that n > 1 gives n different, reproducible samples."""
    seed = body.seed if body.seed is None or choice == 0 else body.seed + choice
    return dict(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                seed=seed, stop=body.stop_list(), ignore_eos=body.ignore_eos,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens,
                stop_token_ids=list(body.stop_token_ids or []),
                logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()},
                allowed_token_ids=list(body.allowed_token_ids or []), bad_words=list(body.bad_words or []),
                cache_salt=body.cache_salt or "", prompt_logprobs=_prompt_logprobs(body),
                logprob_token_ids=list(body.logprob_token_ids or []))


def _prompt_logprobs(body) -> int | None:
    """How many alternatives the workers compute per prompt token: vLLM's prompt_logprobs, and
    /v1/completions' echo with logprobs (the echoed tokens get theirs); None: neither."""
    wanted = [body.prompt_logprobs] if body.prompt_logprobs is not None else []
    if isinstance(body, CompletionRequest) and body.echo and body.logprobs is not None:
        wanted.append(body.logprobs)
    if ALL_LOGPROBS in wanted:          # vLLM's -1: the whole vocabulary, more than any n
        return ALL_LOGPROBS
    return max(wanted) if wanted else None


def _response_id(prefix: str, body) -> str:
    """The response's id: vLLM's `request_id` when the client sent one, else a fresh one."""
    return f"{prefix}-{body.request_id}" if body.request_id else new_request_id(prefix)


def _worker_id(response_id: str, body) -> str:
    """The workers' id of the request (and the x-request-id header): the response's, unless the
    client chose that one — clients reuse ids, two requests in flight on a worker may not share
    one, and a client's text does not belong in a header — then a fresh one."""
    return new_request_id(response_id.split("-", 1)[0]) if body.request_id else response_id


def _truncated(prompt_ids: list[int], body) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the prompt's last k tokens (truncation_side "left",
    the default) or its first k ("right")."""
    k = body.truncate_prompt_tokens
    if not k or len(prompt_ids) <= k:
        return prompt_ids
    return prompt_ids[:k] if body.truncation_side == "right" else prompt_ids[-k:]


def _echo_text(body: CompletionRequest, prompt: str | list[int], prompt_ids: list[int], tokenizer) -> str:
    """What /v1/completions' echo puts before the output, as vLLM does: a text prompt as sent, a
    token-id prompt's whole text (special tokens too), nothing with return_token_ids (the prompt
    comes back as prompt_token_ids instead)."""
    if not body.echo or body.return_token_ids:
        return ""
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids, skip_special_tokens=False)


async def collect_deltas(first: Delta, deltas: AsyncIterator[Delta]) -> list[Delta]:
    collected = [first]
    if first.finish_reason is None:
        async for delta in deltas:
            collected.append(delta)
    return collected


async def collect(fmt, first: Delta, deltas: AsyncIterator[Delta]) -> dict:
    return fmt.full(await collect_deltas(first, deltas))


async def sse_choices(req: Prepared, firsts: list[Delta], streams: list[AsyncIterator[Delta]]
                      ) -> AsyncIterator[bytes]:
    """The writes of a stream of several choices: each choice's chunks as its deltas arrive
    (without per-choice usage chunks), then one usage chunk for the request, then [DONE]."""
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, deltas: AsyncIterator[Delta]) -> None:
        try:
            async for delta in deltas:
                await queue.put((i, delta))
            await queue.put((i, None))
        except BaseException as exc:          # reported in-band below; cancellation ends the pump
            await queue.put((i, exc))
            if isinstance(exc, asyncio.CancelledError):
                raise

    fmts = [c.formatter for c in req.choices]
    lasts: list[Delta | None] = list(firsts)
    pending = b"".join(event(chunk) for f in fmts for chunk in f.opening())
    for i, first in enumerate(firsts):
        pending += b"".join(event(chunk) for chunk in fmts[i].chunks(first))
    live = {i for i, first in enumerate(firsts) if first.finish_reason is None}
    pumps = [asyncio.ensure_future(pump(i, streams[i])) for i in sorted(live)]
    try:
        while live:
            if pending:
                yield pending
                pending = b""
            i, item = await queue.get()
            if item is None:
                live.discard(i)
                continue
            if isinstance(item, BaseException):
                error = item if isinstance(item, APIError) else APIError(
                    502, "the worker ended the stream early", type="server_error")
                yield pending + event(error.body()) + DONE
                return
            lasts[i] = item
            pending += b"".join(event(chunk) for chunk in fmts[i].chunks(item))
            if item.finish_reason is not None:
                live.discard(i)
    finally:
        for p in pumps:
            p.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
    if fmts[0].include_usage:
        usage = merged_usage([d for d in lasts if d is not None], [c.first_of_prompt for c in req.choices])
        pending += event(fmts[0].usage_chunk(usage))
    yield pending + DONE


async def sse(fmt, first: Delta, deltas: AsyncIterator[Delta]) -> AsyncIterator[bytes]:
    """The stream's writes: one per worker message (its events together); the last also
    carries the usage chunk and [DONE], so the end of a stream is one send, not three."""
    pending = b""
    try:
        pending = b"".join(event(chunk) for chunk in fmt.opening())
        delta = first
        while True:
            pending += b"".join(event(chunk) for chunk in fmt.chunks(delta))
            if delta.finish_reason is not None:
                break
            if pending:
                yield pending
                pending = b""
            delta = await anext(deltas)
        pending += b"".join(event(chunk) for chunk in fmt.closing())
    except APIError as exc:
        # Headers are gone already: report in-band, as OpenAI does, and end the stream.
        pending += event(exc.body())
    except StopAsyncIteration:
        pending += event(APIError(502, "the worker ended the stream early", type="server_error").body())
    yield pending + DONE

