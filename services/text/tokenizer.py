"""Tokenizer and chat template of a checkpoint, plus incremental detokenization.

Wraps a `tokenizers.Tokenizer` built from the checkpoint's JSON. Chat templates
are Jinja2 rendered in a sandbox with the helpers Hugging Face templates expect
(`raise_exception`, `tojson`, `strftime_now`); the rendered text already holds
the special tokens, so it is encoded without adding more.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from splitserve.errors import InvalidRequestError, ModelLoadError

if TYPE_CHECKING:       # only its tokenizer fields are read: text work needs nothing of the engine
    from splitserve.checkpoints.checkpoint import Checkpoint


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, ckpt: Checkpoint):
        try:
            self._tok = HFTokenizer.from_str(ckpt.tokenizer_json)
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise ModelLoadError(f"cannot read the tokenizer of {ckpt.name}: {exc}") from exc
        cfg = ckpt.tokenizer_config
        self.chat_template: str | None = cfg.get("chat_template")
        if isinstance(self.chat_template, list):   # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_ids = set()
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            self.eos_token_ids.add(self._tok.token_to_id(self.eos_token))
        self._template: jinja2.Template | None = None

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers.Tokenizer` itself (structured outputs read its vocabulary)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, add_special_tokens: bool = False,
                            variables: dict | None = None) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt, continue_final_message, variables)
        return self.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, variables: dict | None = None) -> str:
        """The chat as the model's template renders it. `continue_final_message`: cut after the
        last message's text, so the model continues it (a prefilled reply); `variables` reach
        the template (chat_template_kwargs, documents, ...)."""
        variables = dict(variables or {})
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token"} & set(variables)
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; send a plain prompt instead")
        if self._template is None:
            self._template = _jinja_env().from_string(self.chat_template)
        try:
            text = self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **variables)
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template failed: {exc}") from exc
        if continue_final_message:
            final = messages[-1].get("content") or ""
            at = text.rfind(final) if final else -1
            if at < 0:
                raise InvalidRequestError("continue_final_message: the chat template does not show the last "
                                          "message's text")
            text = text[:at + len(final)]
        return text


class _TemplateError(jinja2.TemplateError):
    pass


def _raise_exception(message: str):
    raise _TemplateError(message)


def _jinja_env() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


CONTEXT_TOKENS = 4      # tokens decoded before a new one, so it reads as it does in the text


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Streams text for a growing token list without splitting multi-byte characters.

    Decodes a short window (`prefix_offset`..end) and emits what extends past the
    already-emitted part (`read_offset`), holding back an incomplete UTF-8 tail.
    """

    tokenizer: Tokenizer
    token_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""
    skip_special_tokens: bool = True

    @classmethod
    def after(cls, tokenizer: Tokenizer, prompt_ids: Sequence[int],
              skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        """For the tokens that follow `prompt_ids`: decoded after the prompt's last tokens, the
        first one keeps the space it loses at the start of a text (SentencePiece "▁word")."""
        tail = list(prompt_ids[-CONTEXT_TOKENS:])
        return cls(tokenizer, tail, 0, len(tail), skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a stream, emit whatever was held back."""
        full = self._decode(self.token_ids[self.prefix_offset:])
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        delta = full[len(prefix):] if full.startswith(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta
