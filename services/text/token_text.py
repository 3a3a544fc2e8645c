"""The text each generated token adds, for the logprobs of an OpenAI response.

Decoded alone, a token can lose what depends on the tokens before it (a
SentencePiece "▁word" decodes to "word" at the start of a text). Decoded after
the last few tokens before it, what it adds is " word": the piece the streamed
text shows, so a response's logprob tokens join up into its text.
"""

from __future__ import annotations

from splitserve.services.text.tokenizer import CONTEXT_TOKENS, Tokenizer


class TokenTexts:
    """Token pieces in context; `advance` after each chosen token, in order."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.context = list(prompt_ids[-CONTEXT_TOKENS:])
        self.context_text: str | None = None     # decoded on first use: most requests want no logprobs

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def text(self, token_id: int) -> str:
        """What `token_id` would add after the tokens so far."""
        if self.context_text is None:
            self.context_text = self._decode(self.context)
        full = self._decode([*self.context, token_id])
        if full.startswith(self.context_text):
            return full[len(self.context_text):]
        return self._decode([token_id])      # the context ends inside a multi-byte character

    def advance(self, token_id: int) -> str:
        """`token_id` was chosen: its text, and it becomes context for the next one."""
        piece = self.text(token_id)
        self.context = [*self.context, token_id][-CONTEXT_TOKENS:]
        self.context_text = None
        return piece
