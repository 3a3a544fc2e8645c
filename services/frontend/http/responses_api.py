"""POST /v1/responses: OpenAI's Responses API, text in and text out, on the chat path.

A request becomes chat messages (`instructions` first, as a system message, then
`input`: a string is one user message, a list holds message items whose content
is a string or input_text / output_text parts), goes through the model's chat
template and Frontend.generate exactly as a chat completion does — the same
generation route in generation.py parses it, primes the worker stream and
watches the connection — so greedy output is the chat completion's, token for
token. Only the body differs: one Response object (one assistant message item
with one output_text part), or the stream of typed events the official client
folds into that object: response.created, response.in_progress,
response.output_item.added, response.content_part.added, one
response.output_text.delta per worker message with text, then
response.output_text.done, response.content_part.done, response.output_item.done
and response.completed, each with its sequence_number.

A response cut short by max_output_tokens has status "incomplete" and
incomplete_details.reason "max_output_tokens"; its stream still ends with
response.completed, as vLLM's does: the client's get_final_response() needs that
event. The stream ends with the `data: [DONE]` line the chat stream ends with
(generation.sse); the client stops reading there.

Refused with a 400 that says why: tools (no tool-call parser on this route), a
previous_response_id or store=true (responses are not kept, so there is nothing
to continue from or retrieve), background (there is no job store to poll),
reasoning (no reasoning models), and text formats other than plain text.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from splitserve.services.frontend.core import Delta, SamplingRequest, new_request_id
from splitserve.services.frontend.errors import APIError
from splitserve.services.frontend.http.generation import Choice, GenerationEndpoints, Prepared
from splitserve.services.frontend.http.protocol import _Strict
from splitserve.services.worker_protocol.outputs import FinishReason


TEXT_PARTS = ("input_text", "output_text")   # output_text: an earlier response's message, passed back


class ContentPart(_Strict):
    # Any part type is read so that a non-text one (input_image, input_file, ...) is refused
    # by name (unsupported_values), not as "not a valid string"; their fields are not checked.
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None                       # present on items copied from an earlier output
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]


class TextConfig(_Strict):
    format: TextFormat | None = None


class ResponsesRequest(_Strict):
    model: str
    input: str | Annotated[list[MessageItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Accepted at the values that mean "plain text, nothing kept" (unsupported_values).
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto"] | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: dict | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None

    def unsupported_values(self) -> list[tuple[str, str]]:
        problems = []
        for part in self.content_parts():
            if part.type not in TEXT_PARTS:
                problems.append(("input", f"content parts of type {part.type!r} are not supported: this "
                                          "server's models take text only (input_text)"))
            elif part.text is None:
                problems.append(("input", f"an {part.type} content part needs its text"))
        if self.tools:
            problems.append(("tools", "tools are not supported on /v1/responses (no tool-call parsing "
                                      "here); use /v1/chat/completions"))
        if isinstance(self.tool_choice, dict):
            problems.append(("tool_choice", "tool_choice naming a tool needs tools, which /v1/responses "
                                            "does not support"))
        if self.previous_response_id is not None:
            problems.append(("previous_response_id", "splitserve does not keep responses, so there is no "
                                                     "earlier response to continue; send the whole "
                                                     "conversation in `input`"))
        if self.store:
            problems.append(("store", "splitserve does not keep responses (nothing can be retrieved by id); "
                                      "send store=false or leave it out"))
        if self.background:
            problems.append(("background", "background responses need a job store to poll, which splitserve "
                                           "does not have; stream instead"))
        if self.reasoning:
            problems.append(("reasoning", "reasoning options are not supported: no reasoning model is served"))
        if self.text is not None and self.text.format is not None and self.text.format.type != "text":
            problems.append(("text.format", "only the plain text format is supported on /v1/responses"))
        if self.truncation == "auto":
            problems.append(("truncation", "truncation='auto' is not supported: a prompt that does not fit "
                                           "is refused"))
        if self.include:
            problems.append(("include", "include is not supported (no tool outputs or logprobs to add)"))
        return problems

    def content_parts(self) -> list[ContentPart]:
        if isinstance(self.input, str):
            return []
        return [part for item in self.input if not isinstance(item.content, str) for part in item.content]

    def chat_messages(self) -> list[dict]:
        """Instructions, then the input, as the chat template reads messages (developer is system,
        as on /v1/chat/completions)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages.extend({"role": "system" if item.role == "developer" else item.role, "content": item.text()}
                            for item in self.input)
        return messages

    def sampling(self) -> SamplingRequest:
        return SamplingRequest(max_tokens=self.max_output_tokens, default_max_tokens=None,
                               max_tokens_param="max_output_tokens", temperature=self.temperature,
                               top_p=self.top_p)


class ResponsesFormatter:
    """The Response object, whole or as its stream of events (the formatter interface of
    http/responses.py: opening, chunks per delta, closing, full)."""

    def __init__(self, request_id: str, model: str, body: ResponsesRequest, temperature: float, top_p: float):
        self.request_id = request_id
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.body = body
        self.temperature, self.top_p = temperature, top_p
        self.created_at = int(time.time())
        self.sequence_number = 0
        self.text = ""
        self.last: Delta | None = None

    # -- the objects -----------------------------------------------------------------
    def response(self, status: str, output: list[dict], last: Delta | None) -> dict:
        incomplete = status == "incomplete"
        return {
            "id": self.request_id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": self.body.instructions, "max_output_tokens": self.body.max_output_tokens,
            "metadata": self.body.metadata or {}, "output": output, "parallel_tool_calls": False,
            "temperature": self.temperature, "top_p": self.top_p, "tool_choice": "none", "tools": [],
            "store": False, "background": False, "previous_response_id": None, "reasoning": None,
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "user": self.body.user,
            "usage": _usage(last) if last is not None and status != "in_progress" else None,
        }

    def message(self, status: str, content: list[dict]) -> dict:
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status, "content": content}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _status(self, last: Delta) -> str:
        return "incomplete" if last.finish_reason == FinishReason.LENGTH.value else "completed"

    # -- the stream ------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> dict:
        out = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return out

    def _at(self, kind: str, **fields) -> dict:
        return self._event(kind, output_index=0, item_id=self.item_id, content_index=0, **fields)

    def opening(self) -> list[dict]:
        started = self.response("in_progress", [], None)
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started),
                self._event("response.output_item.added", output_index=0, item=self.message("in_progress", [])),
                self._at("response.content_part.added", part=self.part(""))]

    def chunks(self, delta: Delta) -> list[dict]:
        self.last = delta
        if not delta.text:
            return []
        self.text += delta.text
        return [self._at("response.output_text.delta", delta=delta.text, logprobs=[])]

    def closing(self) -> list[dict]:
        if self.last is None:
            return []
        status = self._status(self.last)
        item = self.message(status, [self.part(self.text)])
        return [self._at("response.output_text.done", text=self.text, logprobs=[]),
                self._at("response.content_part.done", part=self.part(self.text)),
                self._event("response.output_item.done", output_index=0, item=item),
                self._event("response.completed", response=self.response(status, [item], self.last))]

    # -- whole -----------------------------------------------------------------------
    def full(self, deltas: list[Delta]) -> dict:
        last = deltas[-1]
        status = self._status(last)
        item = self.message(status, [self.part("".join(d.text for d in deltas))])
        return self.response(status, [item], last)


def _usage(delta: Delta) -> dict:
    return {"input_tokens": delta.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": delta.num_cached_tokens},
            "output_tokens": delta.num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": delta.num_prompt_tokens + delta.num_output_tokens}


class ResponsesRoute:
    """The prepare step of /v1/responses for generation.GenerationEndpoints: parse, template,
    check and build the request with the endpoints' own helpers (the same refusals and metrics
    as the chat route)."""

    def __init__(self, endpoints: GenerationEndpoints):
        self.endpoints = endpoints

    def prepare(self, raw: bytes) -> Prepared:
        ep, frontend = self.endpoints, self.endpoints.frontend
        body = ep._parse(raw, ResponsesRequest, "responses")
        messages = body.chat_messages()
        try:
            ep._check_length("responses", sum(len(msg["content"]) for msg in messages), "input")
            prompt_ids = ep._refusing("responses", lambda: frontend.chat_prompt(messages))
            gen = ep._prepare("responses", new_request_id("resp"), prompt_ids, body.sampling(), "input")
        except APIError as error:
            if error.param in ("messages", "prompt"):     # the chat path's names for what is `input` here
                error.param = "input"
            raise
        formatter = ResponsesFormatter(gen.request_id, frontend.model_name, body, gen.params.temperature,
                                       gen.params.top_p)
        return Prepared([Choice(gen, formatter)], body.stream)
