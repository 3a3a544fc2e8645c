"""vLLM's `bad_words` as token sequences, from the served tokenizer.

A word is banned wherever it would start: at the start of the text (no leading space)
and after a space. vLLM (`SamplingParams.update_from_tokenizer`) therefore encodes each
word twice, as `word.lstrip()` and as `" " + word.lstrip()`, without special tokens,
and keeps the second encoding only when it is a different word token of the same
length (for tokenizers that add the space themselves, both encodings are one). The
engine bans a sequence's last token where the output ends with the others
(services/engine/logits_controls.py).
"""

from __future__ import annotations

from splitserve.services.text.tokenizer import Tokenizer


def bad_word_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    sequences: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if plain:
            sequences.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            sequences.append(spaced)
    return sequences
