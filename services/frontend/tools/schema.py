"""The request schema of tools (OpenAI's, as vLLM accepts it): the tools a chat request offers,
its tool_choice, and the tool calls and tool results its messages carry.

Strict like the rest of http/protocol.py, which takes these models into its own.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

FunctionName = Annotated[str, Field(min_length=1, max_length=64)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None       # a JSON schema
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class CalledFunction(_Strict):
    name: str
    arguments: str                                  # JSON text, as OpenAI returns it


class AssistantToolCall(_Strict):
    """A tool call of an earlier assistant message, sent back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
