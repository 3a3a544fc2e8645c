"""POST /tokenize and /detokenize, with the request and response schemas of vLLM's server.

Clients written against vLLM (benchmark tools, evaluation harnesses, prompt-budget
code) count tokens here before they send a prompt. The shapes are vLLM's: a
tokenize body is either a text (`prompt`, special tokens added by default) or a
chat (`messages` through the model's chat template, which already holds its
special tokens, so none are added by default; continue_final_message and
chat_template_kwargs as on /v1/chat/completions); the answer is `count`, `tokens`,
`max_model_len` and, on request, `token_strs` (the vocabulary's pieces, as
`convert_ids_to_tokens` gives them). Detokenize keeps special tokens, as vLLM's
does, so /tokenize then /detokenize gives back the text the tokens spell.

`model` is optional, as in vLLM; when given it must be the served one. These
are plain FastAPI routes (they never reach a worker), but bodies are parsed by
generation.parse_body so every refusal is the same OpenAI-style error.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Request
from pydantic import Field

from splitserve.services.frontend.core import Frontend
from splitserve.services.frontend.errors import invalid
from splitserve.services.frontend.http.generation import loads_body, parse_body
from splitserve.services.frontend.http.protocol import MAX_TOKEN_ID, ChatMessage, _Strict
from splitserve.services.frontend.tools.choice import message_problems, template_message
from splitserve.services.frontend.tools.schema import Tool

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False

    def unsupported_values(self) -> list[tuple[str, str]]:
        return []


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None      # variables for the template, as on chat
    tools: list[Tool] | None = None                         # the template's `tools`, as on chat

    def unsupported_values(self) -> list[tuple[str, str]]:
        if self.continue_final_message and self.add_generation_prompt:
            return [("continue_final_message", "continue_final_message and add_generation_prompt cannot both "
                                               "be true (send add_generation_prompt=false)")]
        return message_problems(self.messages)

    def chat_messages(self) -> list[dict]:
        """The messages as the chat template reads them (the same mapping as /v1/chat/completions)."""
        return [template_message(msg) for msg in self.messages]

    def template_variables(self) -> dict:
        tools = {"tools": [t.model_dump(exclude_none=True) for t in self.tools]} if self.tools else {}
        return {**(self.chat_template_kwargs or {}), **tools}


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]

    def unsupported_values(self) -> list[tuple[str, str]]:
        return []


def parse_tokenize(raw: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """vLLM's TokenizeRequest is a union told apart by its fields: `messages` makes it a chat.
    (Parsed twice: this route is not on the generation path, and parse_body phrases every error.)"""
    try:
        is_chat = isinstance(data := loads_body(raw), dict) and "messages" in data
    except ValueError:
        is_chat = False                  # parse_body phrases the malformed JSON
    return parse_body(raw, TokenizeChatRequest if is_chat else TokenizeCompletionRequest)


def tokenize(frontend: Frontend, body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
    if isinstance(body, TokenizeChatRequest):
        # The chat completion's own templating (the same prompt a chat request would send).
        tokens = frontend.chat_prompt(
            body.chat_messages(), add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, add_special_tokens=body.add_special_tokens,
            variables=body.template_variables())
    else:
        tokens = frontend.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    out = {"count": len(tokens), "max_model_len": frontend.max_model_len, "tokens": tokens, "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = [frontend.tokenizer.id_to_token(t) for t in tokens]
    return out


def detokenize(frontend: Frontend, body: DetokenizeRequest) -> dict:
    vocab = frontend.tokenizer.vocab_size
    for i, token in enumerate(body.tokens):
        if token >= vocab:
            raise invalid(f"token id {token} (tokens[{i}]) is outside the vocabulary of {vocab} tokens",
                          "tokens", "invalid_value")
    return {"prompt": frontend.tokenizer.decode(body.tokens, skip_special_tokens=False)}


def _check_model(frontend: Frontend, name: str | None) -> None:
    # 503 until a worker is ready, as /v1/models: max_model_len and the served name come from it.
    if name is None:
        name = frontend.model_name
    frontend.check_model(name)


def install_tokenization(app: FastAPI, frontend: Frontend, respond) -> None:
    """Register the two routes; `respond(payload)` makes the JSON response (the app's encoder)."""

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        body = parse_tokenize(await request.body())
        _check_model(frontend, body.model)
        return respond(tokenize(frontend, body))

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        body = parse_body(await request.body(), DetokenizeRequest)
        _check_model(frontend, body.model)
        return respond(detokenize(frontend, body))
