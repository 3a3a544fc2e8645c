"""OpenAI response bodies, streamed (chunks) and whole, for chat and text completions.

A formatter turns the lifecycle's `Delta`s into the JSON objects the OpenAI API
returns. Streams: `opening()` (chat's role chunk), `chunks(delta)` per worker
message, `closing()` (the usage chunk when stream_options.include_usage).
Whole: `full(deltas)`. One formatter per choice (its `index`); `merge_full` and
`merged_usage` join the choices of a request with n > 1 or several prompts.
"""

from __future__ import annotations

import time

from splitserve.proto.v1 import common_pb2
from splitserve.services.text.tokenizer import Tokenizer

from splitserve.services.frontend.core import Delta
from splitserve.services.frontend.http.prompt_logprobs import MIN_LOGPROB, echoed_logprobs, vllm_prompt_logprobs
from splitserve.services.frontend.http.protocol import ChatCompletionRequest, CompletionRequest
from splitserve.services.frontend.tools.choice import ToolOutput
from splitserve.services.text.token_text import TokenTexts


def _logprob(value: float) -> float:
    """OpenAI's (and vLLM's) -9999 for -inf, which JSON cannot carry."""
    return max(value, MIN_LOGPROB)


def _usage(delta: Delta) -> dict:
    return {"prompt_tokens": delta.num_prompt_tokens, "completion_tokens": delta.num_output_tokens,
            "total_tokens": delta.num_prompt_tokens + delta.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": delta.num_cached_tokens}}


class _Formatter:
    object_stream = ""
    object_full = ""

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, body, prompt_ids: list[int],
                 index: int = 0):
        self.request_id = request_id
        self.index = index              # the choice's index: n > 1 and batched prompts have several
        self.model = model
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer, prompt_ids)
        self.created = int(time.time())
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.continuous_usage = bool(self.include_usage and body.stream_options.continuous_usage_stats)
        self.return_token_ids = body.return_token_ids
        self.tokens_as_ids = bool(getattr(body, "return_tokens_as_token_ids", False))
        self.last: Delta | None = None
        self.prompt_ids = prompt_ids
        self.num_prompt_logprobs = getattr(body, "prompt_logprobs", None)    # vLLM's: whole responses carry them
        self.named_logprobs = bool(getattr(body, "logprob_token_ids", None))  # top: the named tokens, all
        self.prompt_ids_due = self.return_token_ids      # streams: prompt_token_ids once, first

    def _prompt_logprobs(self, deltas: list[Delta]) -> list[dict | None] | None:
        """vLLM's prompt_logprobs: null unless asked for."""
        if self.num_prompt_logprobs is None:
            return None
        entries = [lp for d in deltas for lp in (d.prompt_logprobs or [])]
        return vllm_prompt_logprobs(self.tokenizer, self.prompt_ids, entries, self.num_prompt_logprobs,
                                    self.tokens_as_ids)

    def _token_ids(self, token_ids: list[int]) -> list[int] | None:
        """A choice's `token_ids`: vLLM has the field always, null unless return_token_ids."""
        return list(token_ids) if self.return_token_ids else None

    def _stream_prompt_ids(self) -> list[int] | None:
        """`prompt_token_ids` of a stream: with return_token_ids, in its first chunk only."""
        if not self.prompt_ids_due:
            return None
        self.prompt_ids_due = False
        return list(self.prompt_ids)

    def _token_texts(self, lp: common_pb2.TokenLogprob) -> tuple[str, list[str]]:
        """The chosen token's text and its alternatives', in the text before it (vLLM's
        return_tokens_as_token_ids: `token_id:<id>` instead, for tokens that are not text)."""
        if self.tokens_as_ids:
            self.token_texts.advance(lp.token_id)
            return f"token_id:{lp.token_id}", [f"token_id:{t.token_id}" for t in lp.top]
        top = [self.token_texts.text(t.token_id) for t in lp.top]
        return self.token_texts.advance(lp.token_id), top

    def _envelope(self, obj: str, choices: list, delta: Delta | None = None) -> dict:
        out = {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
               "choices": choices}
        if obj == self.object_stream and self.include_usage:
            # vLLM's continuous_usage_stats: every chunk carries the usage so far.
            out["usage"] = _usage(delta) if self.continuous_usage and delta is not None else None
        return out

    def closing(self) -> list[dict]:
        if not self.include_usage or self.last is None:
            return []
        return [self.usage_chunk(_usage(self.last))]

    def usage_chunk(self, usage: dict) -> dict:
        """The stream's last chunk when include_usage: no choices, the request's usage."""
        final = self._envelope(self.object_stream, [])
        final["usage"] = usage
        return final

    def _finish(self, deltas: list[Delta]) -> tuple[str, list[int], list[common_pb2.TokenLogprob], Delta]:
        text = "".join(d.text for d in deltas)
        token_ids = [t for d in deltas for t in d.token_ids]
        logprobs = [lp for d in deltas for lp in d.logprobs]
        return text, token_ids, logprobs, deltas[-1]


class ChatFormatter(_Formatter):
    object_stream = "chat.completion.chunk"
    object_full = "chat.completion"

    def __init__(self, request_id, model, tokenizer, body: ChatCompletionRequest, prompt_ids: list[int],
                 index: int = 0, echo_text: str = "", tools: ToolOutput | None = None):
        super().__init__(request_id, model, tokenizer, body, prompt_ids, index)
        self.logprobs = body.logprobs
        self.num_top = body.top_logprobs or 0
        self.echo_text = echo_text      # vLLM's chat `echo`: the reply starts with the last message
        self.tools = tools              # the output read as content and tool calls (tools/choice.py)

    def _logprobs(self, logprobs: list[common_pb2.TokenLogprob]) -> dict | None:
        if not self.logprobs:
            return None
        content = []
        for lp in logprobs:
            text, top_texts = self._token_texts(lp)
            content.append({"token": text, "logprob": _logprob(lp.logprob), "bytes": list(text.encode()),
                            "top_logprobs": [{"token": t, "logprob": _logprob(value), "bytes": list(t.encode())}
                                             for t, value in self._top(lp, text, top_texts)]})
        return {"content": content}

    def _top(self, lp: common_pb2.TokenLogprob, text: str, top_texts: list[str]) -> list[tuple[str, float]]:
        """vLLM's chat top_logprobs: the first top_logprobs of (the chosen token, then the top-n),
        each token once; all of them for -1 and for logprob_token_ids."""
        entries: dict[int, tuple[str, float]] = {lp.token_id: (text, lp.logprob)}
        for t, top in zip(top_texts, lp.top):
            entries[top.token_id] = (t, top.logprob)     # the chosen one among them keeps its place
        listed = list(entries.values())
        if self.named_logprobs or self.num_top == -1:
            return listed
        return listed[:self.num_top]

    def opening(self) -> list[dict]:
        choice = {"index": self.index, "delta": {"role": "assistant", "content": self.echo_text}, "logprobs": None,
                  "finish_reason": None, "stop_reason": None}
        chunk = self._envelope(self.object_stream, [choice])
        chunk["prompt_token_ids"] = self._stream_prompt_ids()     # vLLM: in its first chunk, null unless asked
        if self.continuous_usage:       # vLLM: the role chunk counts the prompt, nothing generated yet
            n = len(self.prompt_ids)
            chunk["usage"] = {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}
        return [chunk]

    def chunks(self, delta: Delta) -> list[dict]:
        self.last = delta
        if not delta.text and not delta.token_ids and delta.finish_reason is None:
            return []
        message, finish_reason = {"content": delta.text} if delta.text else {}, delta.finish_reason
        if self.tools is not None:
            message, finish_reason = self.tools.delta(delta.text, finish_reason)
        choice = {"index": self.index, "delta": message, "logprobs": self._logprobs(delta.logprobs),
                  "finish_reason": finish_reason, "stop_reason": delta.stop_reason,
                  "token_ids": self._token_ids(delta.token_ids)}
        return [self._envelope(self.object_stream, [choice], delta)]

    def full(self, deltas: list[Delta]) -> dict:
        text, token_ids, logprobs, last = self._finish(deltas)
        message, finish_reason = {"role": "assistant", "content": self.echo_text + text}, last.finish_reason
        if self.tools is not None:
            message, finish_reason = self.tools.message(text, finish_reason)
        choice = {"index": self.index, "message": message, "logprobs": self._logprobs(logprobs),
                  "finish_reason": finish_reason, "stop_reason": last.stop_reason,
                  "token_ids": self._token_ids(token_ids)}
        out = self._envelope(self.object_full, [choice])
        out["usage"] = _usage(last)
        # vLLM's: on the response (not the choice), always present, null unless asked for.
        out["prompt_logprobs"] = self._prompt_logprobs(deltas)
        out["prompt_token_ids"] = list(self.prompt_ids) if self.return_token_ids else None
        return out


class CompletionFormatter(_Formatter):
    object_stream = "text_completion"
    object_full = "text_completion"

    def __init__(self, request_id, model, tokenizer, body: CompletionRequest, prompt_ids: list[int],
                 index: int = 0, echo_text: str = ""):
        super().__init__(request_id, model, tokenizer, body, prompt_ids, index)
        self.logprobs = body.logprobs
        self.offset = 0
        self.echo_text = echo_text      # `echo`: the prompt, before the first generated text
        # echo with logprobs: the echoed prompt tokens lead the logprobs (OpenAI's shape).
        self.echo_logprobs_due = bool(body.echo and body.logprobs is not None)

    def _logprobs(self, logprobs: list[common_pb2.TokenLogprob],
                  prompt_entries: list[common_pb2.TokenLogprob] | None = None) -> dict | None:
        if self.logprobs is None:
            return None
        tokens, tops, offsets, values = [], [], [], []
        if self.echo_logprobs_due and prompt_entries is not None:
            self.echo_logprobs_due = False
            tokens, values, tops, offsets, self.offset = echoed_logprobs(
                self.tokenizer, self.prompt_ids, prompt_entries, self.logprobs, self.tokens_as_ids)
        for lp in logprobs:
            text, top_texts = self._token_texts(lp)
            tokens.append(text)
            # vLLM (as the legacy OpenAI API): the chosen token, then the top-n, by text.
            top = {text: _logprob(lp.logprob)}
            top.update((t, _logprob(alt.logprob)) for t, alt in zip(top_texts, lp.top))
            tops.append(top)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": values + [_logprob(lp.logprob) for lp in logprobs],
                "top_logprobs": tops, "text_offset": offsets}

    def opening(self) -> list[dict]:
        return []

    def chunks(self, delta: Delta) -> list[dict]:
        self.last = delta
        if not delta.text and not delta.token_ids and delta.finish_reason is None:
            return []
        text, self.echo_text = self.echo_text + delta.text, ""
        choice = {"index": self.index, "text": text,
                  "logprobs": self._logprobs(delta.logprobs, _first_prompt_entries([delta])),
                  "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason,
                  # vLLM: the prompt's ids in the choice's first chunk (with return_token_ids), else null
                  "prompt_token_ids": self._stream_prompt_ids(), "token_ids": self._token_ids(delta.token_ids)}
        return [self._envelope(self.object_stream, [choice], delta)]

    def full(self, deltas: list[Delta]) -> dict:
        text, token_ids, logprobs, last = self._finish(deltas)
        choice = {"index": self.index, "text": self.echo_text + text,
                  "logprobs": self._logprobs(logprobs, _first_prompt_entries(deltas)),
                  "finish_reason": last.finish_reason, "stop_reason": last.stop_reason,
                  # vLLM's: on the choice, always present, null unless asked for
                  "prompt_logprobs": self._prompt_logprobs(deltas),
                  "prompt_token_ids": list(self.prompt_ids) if self.return_token_ids else None,
                  "token_ids": self._token_ids(token_ids)}
        out = self._envelope(self.object_full, [choice])
        out["usage"] = _usage(last)
        return out


def _first_prompt_entries(deltas: list[Delta]) -> list[common_pb2.TokenLogprob] | None:
    """The prompt's entries when these deltas hold the request's first tokens, else None."""
    return next((list(d.prompt_logprobs) for d in deltas if d.prompt_logprobs is not None), None)


def merged_usage(lasts: list[Delta], first_of_prompt: list[bool]) -> dict:
    """Usage of a request with several choices: each prompt counted once, every choice's output."""
    prompt = sum(d.num_prompt_tokens for d, first in zip(lasts, first_of_prompt) if first)
    cached = sum(d.num_cached_tokens for d, first in zip(lasts, first_of_prompt) if first)
    completion = sum(d.num_output_tokens for d in lasts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def best_samples(collected: list[list[Delta]], first_of_prompt: list[bool], n: int) -> list[int]:
    """best_of: of each prompt's samples (a run starting at a first_of_prompt), the indexes of
    the `n` with the highest cumulative logprob of their sampled tokens, best first, prompt by
    prompt (vLLM's v0 ranking; the logprobs are the model's, before sampling filters)."""
    kept: list[int] = []
    starts = [i for i, first in enumerate(first_of_prompt) if first] + [len(collected)]
    for start, end in zip(starts, starts[1:]):
        score = {i: sum(lp.logprob for d in collected[i] for lp in d.logprobs) for i in range(start, end)}
        kept += sorted(score, key=lambda i: -score[i])[:n]
    return kept


def merge_full(bodies: list[dict], usage: dict) -> dict:
    """One response body from each choice's whole body (in index order)."""
    out = dict(bodies[0])
    out["choices"] = sorted((c for b in bodies for c in b["choices"]), key=lambda c: c["index"])
    out["usage"] = usage
    return out
