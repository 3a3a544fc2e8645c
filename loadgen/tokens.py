"""Prompt text of an exact token length, built from the model's own vocabulary.

A load generator that claims "2048-token prompts" must send prompts the server
counts as 2048 tokens. Random token ids do not survive a decode→encode round
trip (pieces merge, byte tokens split), and servers other than splitserve only
take text. So prompts are made of *stable words*: vocabulary entries that are
plain ASCII words and that tokenize to exactly one token both at the start of a
text and after a space. Words joined by single spaces then encode to one token
per word, which `PromptVocab.check` verifies for every prompt it builds (a draw
that merges anyway is redrawn, never sent with the wrong length).

A word's token differs by position (`hello` vs `Ġhello` in byte-level BPE; the
same `▁hello` in SentencePiece), so a word is kept with both ids; `ids()` gives
the token ids of a sequence of words exactly as the tokenizer will produce them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from splitserve.errors import SplitserveError

MIN_STABLE_WORDS = 256
MAX_REDRAWS = 20


@dataclass(slots=True, frozen=True)
class Word:
    text: str
    first_id: int      # the token at the start of a text
    mid_id: int        # the token after a space


def load_tokenizer(spec: str):
    """The tokenizer of a splitserve model spec: 'smollm2', a Hugging Face folder or a .gguf file."""
    from splitserve.checkpoints.model_source import open_checkpoint
    from splitserve.services.text.tokenizer import Tokenizer

    return Tokenizer(open_checkpoint(spec))


class PromptVocab:
    """Stable words of one tokenizer and exact-length prompt text made of them."""

    def __init__(self, tokenizer, max_words: int = 4096):
        self.tokenizer = tokenizer
        self.words = _stable_words(tokenizer, max_words)
        if len(self.words) < MIN_STABLE_WORDS:
            raise SplitserveError(f"the tokenizer has only {len(self.words)} stable words "
                                  f"(need {MIN_STABLE_WORDS}); cannot build exact-length prompts")

    # -- counting (what the server will count, given the same tokenizer) --------------
    def count(self, text: str, add_special_tokens: bool = False) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    # -- building ---------------------------------------------------------------------
    def draw(self, rng: random.Random, num_tokens: int) -> list[Word]:
        return [rng.choice(self.words) for _ in range(num_tokens)]

    @staticmethod
    def text(words: list[Word]) -> str:
        return " ".join(w.text for w in words)

    @staticmethod
    def ids(words: list[Word]) -> list[int]:
        return [w.first_id if i == 0 else w.mid_id for i, w in enumerate(words)]

    def check(self, words: list[Word]) -> bool:
        """True when the text of `words` encodes to exactly `ids(words)`."""
        return self.encode(self.text(words)) == self.ids(words)

    def exact(self, rng: random.Random, num_tokens: int, prefix: list[Word] = ()) -> list[Word]:
        """`prefix` followed by `num_tokens` fresh words, redrawn until the whole text round-trips."""
        for _ in range(MAX_REDRAWS):
            words = list(prefix) + self.draw(rng, num_tokens)
            if self.check(words):
                return words
        raise SplitserveError(f"could not build a {len(prefix) + num_tokens}-token prompt that "
                              f"round-trips through the tokenizer in {MAX_REDRAWS} draws")


def _stable_words(tokenizer, max_words: int) -> list[Word]:
    words: list[Word] = []
    seen: set[str] = set()
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id]).strip()
        if not (2 <= len(text) <= 12 and text.isascii() and text.isalpha()) or text in seen:
            continue
        first = tokenizer.encode(text, add_special_tokens=False)
        pair = tokenizer.encode(f"{text} {text}", add_special_tokens=False)
        if len(first) != 1 or len(pair) != 2 or pair[0] != first[0]:
            continue
        seen.add(text)
        words.append(Word(text, first[0], pair[1]))
        if len(words) >= max_words:
            break
    return words
