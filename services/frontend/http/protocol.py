"""The OpenAI HTTP schema that splitserve accepts, as pydantic models.

Models are strict (a string is not an integer) and forbid unknown fields: a
parameter splitserve does not implement is rejected with a message naming it,
never silently ignored. Messages are the exception, as in vLLM's server: clients send
back the message objects they were given (with `audio`, `function_call`, `annotations`...),
so a message's unused fields are ignored, and its role goes to the chat template as is. Fields that exist in the OpenAI API but only have one
supported value are accepted at that value
and rejected otherwise, by `unsupported_values`; best_of >= n generates best_of samples per
prompt and returns the n with the highest cumulative logprob (vLLM's v0 semantics), not
streamed. `n` choices and lists of prompts
on /v1/completions are served as one request per (prompt, choice), concurrently. A few vLLM-style
extensions are accepted too: top_k, min_p, ignore_eos, return_token_ids,
repetition_penalty, min_tokens, stop_token_ids, allowed_token_ids, bad_words, cache_salt,
prompt_logprobs, logprob_token_ids, truncation_side; logprobs of -1 (the whole vocabulary,
within the workers' --max-logprobs).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from splitserve.services.frontend.http.beam_search_api import beam_search_problems
from splitserve.services.frontend.tools.choice import tool_problems
from splitserve.services.frontend.tools.schema import AssistantToolCall, Tool, ToolChoice

ALL_LOGPROBS = -1                # vLLM's logprobs/top_logprobs/prompt_logprobs of -1: the whole vocabulary
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_SEQUENCES = 16
MAX_TOKEN_ID = 2**32 - 1      # the wire's uint32; the worker checks the vocabulary
MAX_TOP_K = 2**31 - 1
MAX_CHOICES = 16              # n, and prompts x n of one completions request
MAX_PROMPTS = 64              # prompts in one /v1/completions request

Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
# A count of logprobs per token: n, or -1 (vLLM's whole vocabulary); the workers' --max-logprobs
# bounds it (core.py, with vLLM's message).
NumLogprobs = Annotated[int, Field(ge=ALL_LOGPROBS, le=MAX_TOKEN_ID)]
StopText = Annotated[str, Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False      # vLLM: usage in every chunk too


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message. Like vLLM's server, fields it does not use are accepted and ignored (clients
    send back the assistant message they were given, with `audio`, `function_call`,
    `annotations`...), and a role the chat template knows is passed to it as is."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Annotated[str, Field(min_length=1)]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None     # an assistant's calls, sent back
    tool_call_id: str | None = None                       # a tool message: the call it answers
    refusal: str | None = None                            # in assistant messages clients send back

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
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
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
        bad_keys = [k for k in self.logit_bias or {} if not (k.isascii() and k.isdigit() and int(k) <= MAX_TOKEN_ID)]
        if bad_keys:
            problems.append(("logit_bias", f"logit_bias keys must be token ids (decimal strings), got {bad_keys[0]!r}"))
        if self.stream_options is not None and not self.stream:
            problems.append(("stream_options", "stream_options is only allowed with stream=true"))
        return problems

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# vLLM's request fields that make no sense for this server, and why (a 400 names the reason).
REFUSED_EXTENSIONS = {
    "chat_template": "a request may not replace the served model's chat template (it is code the server runs)",
    "logits_processors": "a request may not name server-side code to run as a logits processor",
    "mm_processor_kwargs": "the served models take text only (no multimodal processor)",
    "kv_transfer_params": "splitserve moves KV between its prefill and decode workers itself; there is no "
                          "client-driven KV transfer",
    "vllm_xargs": "no custom extensions are loaded that could read vllm_xargs",
    "prompt_embeds": "prompts are token ids or text; embeddings cannot be sent",
}


class _VllmExtensions(_Strict):
    """vLLM's extensions beyond OpenAI's schema, common to chat and completions."""

    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    priority: int = 0      # vLLM's (lower first); non-zero needs --flow-control (flow_headers.check_priority)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    truncation_side: Literal["left", "right"] | None = None    # with truncate_prompt_tokens; None: left
    return_tokens_as_token_ids: bool = False
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Refused with a reason (REFUSED_EXTENSIONS): accepted by the schema so that the 400 says why.
    chat_template: str | None = None
    logits_processors: list[Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    prompt_embeds: str | list[Any] | None = None
    # Structured outputs (structured.py turns them into one StructuredOutput).
    response_format: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # Token controls and the prompt's logprobs (vLLM's extensions).
    prompt_logprobs: NumLogprobs | None = None
    # vLLM's: each generated token's top logprobs are these tokens' (needs logprobs).
    logprob_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]], Field(min_length=1)] | None = None
    allowed_token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] | None = None  # the worker checks the vocab
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None   # vLLM: non-empty

    def extension_problems(self) -> list[tuple[str, str]]:
        problems = [(name, f"{name} is not supported: {why}") for name, why in REFUSED_EXTENSIONS.items()
                    if getattr(self, name, None) is not None]
        if self.prompt_logprobs and getattr(self, "stream", False):     # vLLM's rule and words
            problems.append(("prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`."))
        if self.allowed_token_ids == []:
            problems.append(("allowed_token_ids", "allowed_token_ids must not be empty: no token could be sampled"))
        problems += beam_search_problems(self)
        if not self.spaces_between_special_tokens:
            problems.append(("spaces_between_special_tokens", "the served tokenizers (fast, tokenizers-library) "
                                                              "never put spaces between special tokens; only "
                                                              "true is accepted"))
        return problems


class ChatCompletionRequest(_Common, _VllmExtensions):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    # vLLM's chat extensions
    echo: bool = False                   # the reply starts with the last message, when it is the assistant's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None   # a template variable
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = None
    tools: list[Tool] | None = None          # tools/choice.py: the template's `tools`, the choice
    tool_choice: ToolChoice | None = None

    def unsupported_values(self) -> list[tuple[str, str]]:
        problems = super().unsupported_values() + self.extension_problems() + tool_problems(self)
        if self.continue_final_message and self.add_generation_prompt:
            problems.append(("continue_final_message", "continue_final_message needs add_generation_prompt=false"))
        if self.continue_final_message and self.messages[-1].role != "assistant":
            problems.append(("continue_final_message", "continue_final_message continues the last message, "
                                                       "which must be the assistant's"))
        if self.top_logprobs is not None and not self.logprobs:
            problems.append(("top_logprobs", "top_logprobs needs logprobs=true"))
        if self.logprob_token_ids and not self.logprobs:          # vLLM's words
            problems.append(("logprob_token_ids", "when using `logprob_token_ids`, `logprobs` must be set to true."))
        return problems

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]], Field(min_length=1)]


class CompletionRequest(_Common, _VllmExtensions):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = 16
    logprobs: NumLogprobs | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True      # vLLM: BOS etc. as the tokenizer adds them to a text prompt

    def unsupported_values(self) -> list[tuple[str, str]]:
        problems = super().unsupported_values() + self.extension_problems()
        prompts = self.prompts()
        if not prompts:
            problems.append(("prompt", "prompt must not be an empty list"))
        elif len(prompts) > MAX_PROMPTS:
            problems.append(("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}"))
        elif len(prompts) * self.num_samples > MAX_CHOICES * 4:
            what = "best_of" if self.best_of else "n"
            problems.append((what, f"prompts x {what} must be at most {MAX_CHOICES * 4}, "
                                   f"got {len(prompts) * self.num_samples}"))
        if self.logprob_token_ids and self.logprobs is None:      # vLLM's words
            problems.append(("logprob_token_ids", "when using `logprob_token_ids`, `logprobs` must be set."))
        if self.suffix:
            problems.append(("suffix", "suffix (insertion) is not supported: the served models are not "
                                       "fill-in-the-middle models"))
        if self.best_of is not None and not self.num_choices <= self.best_of <= MAX_CHOICES:
            problems.append(("best_of", f"best_of must be between n ({self.num_choices}) and {MAX_CHOICES}, "
                                        f"got {self.best_of}"))
        elif self.stream and self.num_samples != self.num_choices:
            problems.append(("best_of", "best_of > n cannot be streamed: which n of the best_of samples are "
                                        "returned is only known once all have finished; send stream=false "
                                        "(or best_of = n)"))
        return problems

    @property
    def num_samples(self) -> int:
        """Samples generated per prompt: best_of (the n with the highest cumulative logprob are
        returned), else n."""
        return self.best_of or self.num_choices

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or the list (of strings or of token-id lists) it sent."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)
        return [prompt] if prompt != [] else []
