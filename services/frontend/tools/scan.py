"""Tool calls found in a growing JSON text, as OpenAI's streamed `tool_calls` deltas.

A model writes a tool call as a JSON object such as `{"name": "f", "arguments": {...}}`, one
token at a time. OpenAI streams it as deltas: first one with the call's index, id, type and
name (arguments ""), then fragments of the arguments' JSON text, which concatenate to it.
`CallScanner` reads the text character by character, once (a tool call's text is scanned in
O(length), however it is cut into deltas), keeping only what JSON's syntax needs: the depth,
whether it is inside a string, and, inside a call object, which member it is in. It never
parses a partial value: the arguments are streamed as the model's own text, so no fragment
is ever retracted (vLLM's parsers re-serialize partial JSON and diff it, which breaks on
values whose serialization changes as they grow).

Call objects sit at `object_depth`: 0 for a sequence of objects (Hermes bodies, Llama 3's
`; `-separated calls), 1 for the objects of an array (the `required` choice's output).
Anything at a smaller depth (brackets, separators, text between objects) is skipped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

_WHITESPACE = " \t\r\n"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class _Call:
    """One call object as far as it has been read."""

    index: int
    id: str = field(default_factory=new_call_id)
    name: str | None = None
    args_start: int = -1          # where the arguments' value starts in the text (-1: not yet)
    args_end: int = -1            # ...and ends (-1: still open)
    args_primitive: bool = False  # a bare value (null, a number): streamed only once complete
    emitted: int = -1             # the arguments' text is sent up to here
    name_sent: bool = False
    closed: bool = False


@dataclass(slots=True)
class CallScanner:
    object_depth: int = 0
    name_key: str = "name"
    argument_keys: tuple[str, ...] = ("arguments", "parameters")
    text: str = ""
    calls: list[_Call] = field(default_factory=list)
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _string_start: int = -1
    _state: str = "key"           # inside a call object: key, colon, value, in_value, after
    _key: str | None = None
    _value_start: int = -1
    _value_kind: str = ""         # string, container, primitive

    def feed(self, text: str) -> list[dict]:
        """Read `text` (the next piece of the output); the `tool_calls` deltas it completes."""
        start = len(self.text)
        self.text += text
        for pos in range(start, len(self.text)):
            self._step(pos, self.text[pos])
        return self._deltas()

    def finish(self) -> list[dict]:
        """At the end of the output: a call whose object closed without arguments gets `{}`."""
        return self._deltas()

    def complete_calls(self) -> list[tuple[str, str]]:
        """(name, arguments' JSON text) of each call whose object closed, in order."""
        out = []
        for call in self.calls:
            if call.closed and call.name is not None:
                out.append((call.name, self.text[call.args_start:call.args_end] if call.args_end >= 0 else "{}"))
        return out

    # -- the syntax -------------------------------------------------------------------
    def _step(self, pos: int, ch: str) -> None:
        member_depth = self.object_depth + 1
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
                if self._depth == member_depth:
                    self._string_closed(pos)
            return
        if self._depth == member_depth and self._state == "in_value" and self._value_kind == "primitive" \
                and ch in ",}":
            self._end_value(len(self.text[:pos].rstrip(_WHITESPACE)))
        if ch == '"':
            self._in_string = True
            self._string_start = pos
            if self._depth == member_depth and self._state == "value":
                self._begin_value(pos, "string")
        elif ch in "{[":
            if self._depth == self.object_depth and ch == "{":
                self.calls.append(_Call(index=len(self.calls)))
                self._state, self._key = "key", None
            elif self._depth == member_depth and self._state == "value":
                self._begin_value(pos, "container")
            self._depth += 1
        elif ch in "}]":
            self._depth = max(0, self._depth - 1)
            if self._depth == member_depth and self._state == "in_value" and self._value_kind == "container":
                self._end_value(pos + 1)
            elif self._depth == self.object_depth and ch == "}" and self.calls:
                self.calls[-1].closed = True
        elif self._depth == member_depth:
            if ch == ":" and self._state == "colon":
                self._state = "value"
            elif ch == "," and self._state in ("after", "in_value"):
                self._state = "key"
            elif ch not in _WHITESPACE and self._state == "value":
                self._begin_value(pos, "primitive")

    def _string_closed(self, pos: int) -> None:
        if self._state == "key":
            self._key = _loads(self.text[self._string_start:pos + 1])
            self._state = "colon"
        elif self._state == "in_value" and self._value_kind == "string":
            self._end_value(pos + 1)

    def _begin_value(self, pos: int, kind: str) -> None:
        self._state, self._value_start, self._value_kind = "in_value", pos, kind
        call = self.calls[-1]
        if self._key in self.argument_keys and call.args_start < 0:
            call.args_start, call.emitted, call.args_primitive = pos, pos, kind == "primitive"

    def _end_value(self, end: int) -> None:
        self._state = "after"
        call = self.calls[-1]
        if self._key == self.name_key and call.name is None:
            name = _loads(self.text[self._value_start:end])
            call.name = name if isinstance(name, str) and name else None
        elif self._key in self.argument_keys and call.args_start == self._value_start:
            call.args_end = end

    # -- the deltas -------------------------------------------------------------------
    def _deltas(self) -> list[dict]:
        out = []
        for call in self.calls:
            if call.name is None:
                continue          # OpenAI sends the name first: the arguments wait for it
            entry: dict | None = None
            if not call.name_sent:
                call.name_sent = True
                entry = {"index": call.index, "id": call.id, "type": "function",
                         "function": {"name": call.name, "arguments": ""}}
            fragment = self._new_arguments(call)
            if fragment:
                entry = entry or {"index": call.index, "function": {}}
                entry["function"]["arguments"] = fragment
            if entry is not None:
                out.append(entry)
        return out

    def _new_arguments(self, call: _Call) -> str:
        if call.args_start < 0:
            if call.closed and call.emitted < 0:     # no arguments member: OpenAI's empty object
                call.emitted = 0
                return "{}"
            return ""
        if call.args_end >= 0:
            upto = call.args_end
        elif call.args_primitive:
            return ""
        else:
            upto = len(self.text)
        fragment = self.text[call.emitted:upto]
        call.emitted = max(call.emitted, upto)
        return fragment


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None
