"""Tool-call parsers: the calls in a model's output, per model family, whole and streamed.

The families are vLLM's `--tool-call-parser` names, with its rules:
- `hermes` (Hermes 2/3, Qwen 2.5/3): each call is `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`; the text before the first tag is the message's content.
- `llama3_json` (Llama 3.1/3.2/3.3): the output is one or more `{"name": ..., "parameters": {...}}`
  objects separated by `; `, optionally after `<|python_tag|>`; an output that does not start
  with one is plain content.
Two more read the outputs that structured outputs force (tools/choice.py): `required`, a JSON
array of `{"name", "parameters"}`, and a named function, whose whole output is its arguments.

A whole output is parsed with `json` (vLLM's extract_tool_calls: an output that does not parse
is content, not calls). A stream is parsed as it grows (scan.CallScanner): each parser's
`feed(text)` returns the content to send and the `tool_calls` deltas; `finish()` flushes what
was held back (text that might have been the start of a tag).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from splitserve.services.frontend.tools.scan import CallScanner, new_call_id

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
LLAMA_PYTHON_TAG = "<|python_tag|>"
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str                # the arguments' JSON text
    id: str = field(default_factory=new_call_id)

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class Extracted:
    content: str | None
    calls: list[ToolCall]


def _call(obj, argument_keys: tuple[str, ...]) -> ToolCall:
    """A parsed call object; ValueError when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError("not a tool call object")
    arguments = next((obj[k] for k in argument_keys if k in obj), {})
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def extract_hermes(text: str) -> Extracted:
    if HERMES_START not in text:
        return Extracted(text, [])
    try:
        bodies = [closed or open_ for closed, open_ in _HERMES_CALL.findall(text)]
        calls = [_call(json.loads(body), ("arguments", "parameters")) for body in bodies]
    except ValueError:
        return Extracted(text, [])
    return Extracted(text[:text.find(HERMES_START)] or None, calls)


def extract_llama3_json(text: str) -> Extracted:
    body = text.lstrip()
    if body.startswith(LLAMA_PYTHON_TAG):
        body = body[len(LLAMA_PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return Extracted(text, [])
    decoder, calls, at = json.JSONDecoder(), [], 0
    try:
        while at < len(body):
            obj, end = decoder.raw_decode(body, at)
            calls.append(_call(obj, ("parameters", "arguments")))
            at = end
            while at < len(body) and body[at] in "; \t\r\n":
                at += 1
    except ValueError:
        return Extracted(text, [])
    return Extracted(None, calls)


def extract_required(text: str) -> Extracted:
    """`tool_choice="required"`: the output is a JSON array of {"name", "parameters"}. One cut
    short (max_tokens) still has the calls that were written whole, as its stream sent them."""
    try:
        items = json.loads(text)
        if not isinstance(items, list) or not items:
            raise ValueError("not a list of calls")
        return Extracted(None, [_call(item, ("parameters",)) for item in items])
    except ValueError:
        pass
    scanner = CallScanner(object_depth=1, argument_keys=("parameters",))
    scanner.feed(text)
    try:
        calls = [ToolCall(name, json.dumps(json.loads(args), ensure_ascii=False))
                 for name, args in scanner.complete_calls()]
    except ValueError:
        calls = []
    return Extracted(None if calls else text, calls)


def extract_named(text: str, name: str) -> Extracted:
    """A named tool choice: the whole output is that function's arguments."""
    return Extracted(None, [ToolCall(name, text)])


def _held_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass(slots=True)
class HermesStream:
    """Content until the first `<tool_call>`; each tag's body goes to one scanner (the calls
    are numbered across tags); text between and after the tags is dropped, as when whole."""

    scanner: CallScanner = field(default_factory=CallScanner)
    pending: str = ""
    in_call: bool = False
    seen_call: bool = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        content, body = "", ""
        while True:
            tag = HERMES_END if self.in_call else HERMES_START
            at = self.pending.find(tag)
            cut = at if at >= 0 else len(self.pending) - _held_prefix(self.pending, tag)
            if self.in_call:
                body += self.pending[:cut]
            elif not self.seen_call:
                content += self.pending[:cut]
            if at < 0:
                self.pending = self.pending[cut:]
                break
            self.pending = self.pending[at + len(tag):]
            self.seen_call = self.seen_call or not self.in_call
            self.in_call = not self.in_call
        return content, self.scanner.feed(body) if body else []

    def finish(self) -> tuple[str, list[dict]]:
        rest, self.pending = self.pending, ""
        if self.in_call:
            return "", self.scanner.feed(rest) + self.scanner.finish()
        return ("" if self.seen_call else rest), self.scanner.finish()


@dataclass(slots=True)
class Llama3JsonStream:
    """Calls when the output starts with `{` (or `<|python_tag|>`), else all of it is content."""

    scanner: CallScanner = field(default_factory=CallScanner)
    pending: str = ""
    mode: str = ""                # "" (undecided), calls, content

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.mode == "content":
            return text, []
        if self.mode == "calls":
            return "", self.scanner.feed(text)
        self.pending += text
        head = self.pending.lstrip()
        if not head or LLAMA_PYTHON_TAG.startswith(head):
            return "", []         # too early to tell
        if head.startswith(LLAMA_PYTHON_TAG):
            head = head[len(LLAMA_PYTHON_TAG):]
        elif not head.startswith("{"):
            self.mode, content, self.pending = "content", self.pending, ""
            return content, []
        self.mode, self.pending = "calls", ""
        return "", self.scanner.feed(head)

    def finish(self) -> tuple[str, list[dict]]:
        if self.mode == "calls":
            return "", self.scanner.finish()
        rest, self.pending = self.pending, ""
        return rest, []


@dataclass(slots=True)
class RequiredStream:
    """`tool_choice="required"`: the calls are the objects of the output's JSON array."""

    scanner: CallScanner = field(default_factory=lambda: CallScanner(object_depth=1, argument_keys=("parameters",)))

    def feed(self, text: str) -> tuple[str, list[dict]]:
        return "", self.scanner.feed(text)

    def finish(self) -> tuple[str, list[dict]]:
        return "", self.scanner.finish()


@dataclass(slots=True)
class NamedStream:
    """A named tool choice: the name with the first piece of output, then the rest as arguments."""

    name: str
    id: str = field(default_factory=new_call_id)
    started: bool = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if not self.started:
            self.started = True
            return "", [{"index": 0, "id": self.id, "type": "function",
                         "function": {"name": self.name, "arguments": text}}]
        return "", [{"index": 0, "function": {"arguments": text}}] if text else []

    def finish(self) -> tuple[str, list[dict]]:
        return self.feed("") if not self.started else ("", [])


# --tool-call-parser NAME -> (whole-output parser, stream parser)
PARSERS = {"hermes": (extract_hermes, HermesStream), "llama3_json": (extract_llama3_json, Llama3JsonStream)}
