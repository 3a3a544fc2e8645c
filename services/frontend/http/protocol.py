"""The OpenAI HTTP schema that splitserve accepts, as pydantic models.

Models are strict (a string is not an integer) and forbid unknown fields: a
parameter splitserve does not implement is rejected with a message naming it,
never silently ignored. Fields that exist in the OpenAI API but only have one
supported value (n, best_of, echo) are accepted at that
value and rejected otherwise, by `unsupported_values`. A few vLLM-style
extensions are accepted too: top_k, min_p, ignore_eos, return_token_ids,
repetition_penalty, min_tokens, stop_token_ids.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOP_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_SEQUENCES = 16
MAX_TOKEN_ID = 2**32 - 1      # the wire's uint32; the worker checks the vocabulary
MAX_TOP_K = 2**31 - 1

Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
StopText = Annotated[str, Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class _Common(_Strict):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: Seed | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None      # token id (as a string) -> bias, clamped to [-100, 100]
    user: str | None = None
    # extensions (vLLM-style)
    top_k: int | None = Field(default=None, ge=0, le=MAX_TOP_K)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    ignore_eos: bool = False
    return_token_ids: bool = False
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] | None = None

    def unsupported_values(self) -> list[tuple[str, str]]:
        """(param, message) for each parameter set to a value splitserve cannot honour."""
        problems = []
        if self.n not in (None, 1):
            problems.append(("n", "only n=1 is supported; send separate requests for more choices"))
        bad_keys = [k for k in self.logit_bias or {} if not (k.isascii() and k.isdigit() and int(k) <= MAX_TOKEN_ID)]
        if bad_keys:
            problems.append(("logit_bias", f"logit_bias keys must be token ids (decimal strings), got {bad_keys[0]!r}"))
        if self.stream_options is not None and not self.stream:
            problems.append(("stream_options", "stream_options is only allowed with stream=true"))
        return problems

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def unsupported_values(self) -> list[tuple[str, str]]:
        problems = super().unsupported_values()
        if self.top_logprobs is not None and not self.logprobs:
            problems.append(("top_logprobs", "top_logprobs needs logprobs=true"))
        return problems

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]], Field(min_length=1)]


class CompletionRequest(_Common):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported_values(self) -> list[tuple[str, str]]:
        problems = super().unsupported_values()
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                problems.append(("prompt", "batched prompts are not supported; send one prompt per request"))
        if self.echo:
            problems.append(("echo", "echo is not supported"))
        if self.suffix:
            problems.append(("suffix", "suffix is not supported"))
        if self.best_of not in (None, 1):
            problems.append(("best_of", "only best_of=1 is supported"))
        return problems

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return prompt[0]
        return prompt
