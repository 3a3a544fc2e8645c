"""What a chat request's `tools` and `tool_choice` make of it, with vLLM's rules.

- the tools reach the chat template as its `tools` variable (unless there are none);
- `tool_choice` (default "auto" when tools are given, as in vLLM and OpenAI):
  `none`: the output is content; `auto`: the server's `--tool-call-parser` finds calls in the
  output (without `--enable-auto-tool-choice` and a parser, a 400, as vLLM answers);
  `required`: structured outputs force a JSON array of `{"name", "parameters"}` with at
  least one call (vLLM's `_get_json_schema_from_tool`), read back as the calls;
  a named function: structured outputs force its parameters' schema, and the whole output
  is that call's arguments.
- finish_reason is "tool_calls" when calls were made by `auto` or `required` and the model
  stopped by itself; a named choice keeps "stop", as OpenAI answers.

`ToolOutput` (one per choice) turns the output text into the message's content and
`tool_calls`, whole or as streamed deltas (tools/parsers.py).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field

from splitserve.services.frontend.errors import invalid
from splitserve.services.frontend.tools import parsers as p
from splitserve.services.worker_protocol.sampling_params import StructuredOutput

AUTO_NEEDS_PARSER = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
_EMPTY_OBJECT = {"type": "object", "properties": {}}


def tool_problems(body) -> list[tuple[str, str]]:
    """(param, message) for tools/tool_choice/messages that vLLM's check_tool_usage refuses."""
    problems = []
    choice, tools = body.tool_choice, body.tools
    if choice not in (None, "none") and tools is None:
        problems.append(("tool_choice", "When using `tool_choice`, `tools` must be set."))
    elif choice is not None and not isinstance(choice, str) and \
            choice.function.name not in {t.function.name for t in tools}:
        problems.append(("tool_choice", "The tool specified in `tool_choice` does not match any of the "
                                        "specified `tools`"))
    names = [t.function.name for t in tools or []]
    if len(set(names)) < len(names):
        problems.append(("tools", "each tool must have its own function name"))
    return problems + message_problems(body.messages)


def message_problems(messages) -> list[tuple[str, str]]:
    """(param, message) for tool calls a conversation may not carry (templates read their
    arguments as objects, so they must be JSON)."""
    problems = []
    for i, message in enumerate(messages):
        if message.role == "tool" and not message.tool_call_id:
            problems.append((f"messages.{i}.tool_call_id", "a tool message must say which call it answers "
                                                           "(tool_call_id)"))
        if message.tool_calls and message.role != "assistant":
            problems.append((f"messages.{i}.tool_calls", "only an assistant message may have tool_calls"))
        for call in message.tool_calls or []:
            try:
                json.loads(call.function.arguments)
            except ValueError:
                problems.append((f"messages.{i}.tool_calls", f"the arguments of tool call {call.id!r} are not "
                                                             "JSON"))
    return problems


def tool_setup(body, parser: str | None) -> "tuple[ToolSetup | None, StructuredOutput | None]":
    """The request's tools and the grammar its choice needs; a 400 where vLLM gives one."""
    try:
        setup = ToolSetup.of(body, parser)
        return setup, setup.structured() if setup else None
    except ValueError as exc:
        raise invalid(str(exc), "tool_choice") from None


def template_message(message) -> dict:
    """A request's message as chat templates read it: text content; an assistant's tool calls
    with their arguments as objects (as Hugging Face templates expect, and vLLM passes them);
    a tool result's tool_call_id (and name)."""
    out = {"role": "system" if message.role == "developer" else message.role, "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                             for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.role == "tool" and message.name is not None:
        out["name"] = message.name
    return out


@dataclass(slots=True)
class ToolSetup:
    """One request's tools: the template's variable, the choice, the parser of the output."""

    tools: list[dict]                     # as the template sees them (OpenAI's tool objects)
    mode: str                             # none, auto, required, named
    name: str | None = None               # the named choice's function
    parser: str | None = None             # auto: the --tool-call-parser
    parallel: bool = True                 # parallel_tool_calls (false: the first call only)
    parameters: dict[str, dict | None] = field(default_factory=dict)   # function name -> its schema

    @classmethod
    def of(cls, body, parser: str | None) -> "ToolSetup | None":
        """None when the request has no tools; ValueError(message) for auto without a parser."""
        if not body.tools:
            return None
        choice = body.tool_choice or "auto"
        mode, name = ("named", choice.function.name) if not isinstance(choice, str) else (choice, None)
        if mode == "auto" and parser is None:
            raise ValueError(AUTO_NEEDS_PARSER)
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
        return cls(tools, mode, name, parser if mode == "auto" else None, body.parallel_tool_calls is not False,
                   {t.function.name: copy.deepcopy(t.function.parameters) for t in body.tools})

    def template_variables(self) -> dict:
        return {"tools": self.tools}

    def structured(self) -> StructuredOutput | None:
        """The grammar that enforces `required` or a named choice; None for auto and none."""
        if self.mode == "named":
            return StructuredOutput("json_schema", json.dumps(self.parameters[self.name] or _EMPTY_OBJECT))
        if self.mode == "required":
            return StructuredOutput("json_schema", json.dumps(required_schema(self.parameters, self.parallel)))
        return None

    def output(self) -> "ToolOutput | None":
        """A fresh reader of one choice's output; None when the output is plain content."""
        if self.mode == "none":
            return None
        if self.mode == "named":
            return ToolOutput(self, lambda text: p.extract_named(text, self.name), p.NamedStream(self.name))
        if self.mode == "required":
            return ToolOutput(self, p.extract_required, p.RequiredStream())
        whole, stream = p.PARSERS[self.parser]
        return ToolOutput(self, whole, stream())


def required_schema(parameters: dict[str, dict | None], parallel: bool = True) -> dict:
    """vLLM's schema of `tool_choice="required"`: an array of at least one call, each call one of
    the tools (its name as an enum, its parameters' schema); the tools' `$defs` are hoisted to
    the top (a name with two different definitions cannot be). `parallel_tool_calls=false`:
    exactly one call (maxItems 1), so the model is not left to add calls that are dropped."""
    branches, defs = [], {}
    for name, schema in parameters.items():
        schema = copy.deepcopy(schema) if schema else dict(_EMPTY_OBJECT)
        tool_defs = schema.pop("$defs", {})
        if not isinstance(tool_defs, dict):
            raise ValueError(f"the $defs of tool {name!r} must be an object")
        for def_name, definition in tool_defs.items():
            if defs.setdefault(def_name, definition) != definition:
                raise ValueError(f"Tool definition '{def_name}' has multiple schemas, which is not supported.")
        branches.append({"properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                         "required": ["name", "parameters"]})
    out: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if not parallel:
        out["maxItems"] = 1
    if defs:
        out["$defs"] = defs
    return out


@dataclass(slots=True)
class ToolOutput:
    """One choice's output read as content and tool calls, whole or streamed."""

    setup: ToolSetup
    whole_parser: object                  # text -> parsers.Extracted
    stream: object                        # a parsers.*Stream
    called: bool = False

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole message (role, content, tool_calls) and the choice's finish_reason."""
        extracted = self.whole_parser(text)
        calls = extracted.calls if self.setup.parallel else extracted.calls[:1]
        self.called = bool(calls)
        message: dict = {"role": "assistant", "content": extracted.content if calls else text}
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        return message, self.finish_reason(finish_reason)

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A stream chunk's delta for the next text (and, on the last, what was held back)."""
        content, calls = self.stream.feed(text) if text else ("", [])
        if finish_reason is not None:
            more_content, more_calls = self.stream.finish()
            content, calls = content + more_content, calls + more_calls
        if not self.setup.parallel:
            calls = [c for c in calls if c["index"] == 0]
        self.called = self.called or bool(calls)
        delta: dict = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        return delta, self.finish_reason(finish_reason)

    def finish_reason(self, reason: str | None) -> str | None:
        if reason == "stop" and self.called and self.setup.mode in ("auto", "required"):
            return "tool_calls"
        return reason
