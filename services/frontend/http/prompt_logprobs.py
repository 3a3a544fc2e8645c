"""The prompt's logprobs in a response: vLLM's `prompt_logprobs`, and `echo` with `logprobs`.

The worker that ran the prefill sends, with the first token, one entry per prompt token
from the second on (services/engine/prompt_logprobs.py): the token's logprob, its rank
and the top-n. Two shapes come out of them:
- vLLM's `prompt_logprobs` (on the completion choice, on the chat response): a list with
  one item per prompt token, `None` for the first, else `{token id: {logprob, rank,
  decoded_token}}` holding the prompt token first, then the top-n (rank 1, 2, ...);
- OpenAI's echo with logprobs on /v1/completions: the echoed prompt tokens lead the
  choice's `logprobs` lists, the first with a `None` logprob and `None` alternatives, the
  others' alternatives led by the prompt token itself (as vLLM's prompt logprob dicts are).
Token texts are those each token adds in the prompt's context (text/token_text.py), as
for generated tokens; `return_tokens_as_token_ids` writes `token_id:<id>` instead.
"""

from __future__ import annotations

from splitserve.proto.v1 import common_pb2
from splitserve.services.text.token_text import TokenTexts
from splitserve.services.text.tokenizer import Tokenizer


MIN_LOGPROB = -9999.0      # OpenAI's stand-in for -inf


def _first(top, n: int):
    """The n most likely alternatives; all of them for vLLM's -1."""
    return list(top) if n < 0 else top[:n]


def vllm_prompt_logprobs(tokenizer: Tokenizer, prompt_ids: list[int], entries: list[common_pb2.TokenLogprob],
                         n: int, tokens_as_ids: bool = False) -> list[dict | None]:
    texts = TokenTexts(tokenizer, prompt_ids[:1])
    out: list[dict | None] = [None]
    for entry in entries:
        text = lambda t: f"token_id:{t}" if tokens_as_ids else texts.text(t)  # noqa: E731
        item = {str(entry.token_id): {"logprob": entry.logprob, "rank": entry.rank or None,
                                      "decoded_token": text(entry.token_id)}}
        for rank, top in enumerate(_first(entry.top, n), start=1):
            item.setdefault(str(top.token_id), {"logprob": top.logprob, "rank": rank,
                                                "decoded_token": text(top.token_id)})
        texts.advance(entry.token_id)
        out.append(item)
    return out


def echoed_logprobs(tokenizer: Tokenizer, prompt_ids: list[int], entries: list[common_pb2.TokenLogprob],
                    n: int, tokens_as_ids: bool = False) -> tuple[list[str], list, list, list[int], int]:
    """(tokens, token_logprobs, top_logprobs, text_offset, the offset after the prompt) of the
    echoed prompt, in /v1/completions' logprobs shape."""
    texts = TokenTexts(tokenizer, [])
    tokens, logprobs, tops, offsets = [], [], [], []
    offset = 0
    for i, token_id in enumerate(prompt_ids):
        entry = entries[i - 1] if 0 < i <= len(entries) else None
        if entry is None:
            logprobs.append(None)
            tops.append(None)
        else:
            logprobs.append(max(entry.logprob, MIN_LOGPROB))
            # vLLM's: the prompt token itself, then its top-n alternatives, by text.
            text = lambda t: f"token_id:{t}" if tokens_as_ids else texts.text(t)  # noqa: E731
            top = {text(token_id): max(entry.logprob, MIN_LOGPROB)}
            top.update((text(t.token_id), max(t.logprob, MIN_LOGPROB)) for t in _first(entry.top, n))
            tops.append(top)
        piece = texts.advance(token_id)
        tokens.append(f"token_id:{token_id}" if tokens_as_ids else piece)
        offsets.append(offset)
        offset += len(piece)
    return tokens, logprobs, tops, offsets, offset
