"""Per-request changes to a batch's logits before sampling: allowed tokens, bad words,
min_tokens, logit_bias, penalties.

vLLM's semantics and order (its v1 sampler): first the masks — allowed_token_ids
(every other token at -inf) and bad_words (a bad word's last token at -inf where
the output ends with the word's other tokens; a one-token word always) — then the
processors that can change the argmax — min_tokens (EOS and stop_token_ids at -inf
until that many tokens were generated) and logit_bias (added to the named tokens)
— then the penalties: repetition over prompt + output (transformers' rule: a seen
token's positive logit is divided by the penalty, a negative one multiplied),
frequency (subtracted per occurrence in the output) and presence (subtracted once
if the output holds the token). Temperature, top-k/top-p/min-p come after, in
sampler.py; greedy rows take the argmax of these controlled logits.

Each control is applied to the whole batch at once (index tensors, one masked
fill or index_put), and skipped entirely when no row asks for it, so a batch
without them pays nothing. The penalties read each sequence's `TokenCounts`, which
the engine keeps as tokens are accepted (one array increment per token): a step
costs one stack of [rows, vocab] counts, not a count over the whole history. The
counts are built once from prompt + output when a sequence first needs them (a
request continued after a migration gets its earlier output as part of the prompt,
and `num_prior_output_tokens` says how many of the prompt's last tokens are output,
so the counts, and the tail that bad words look at, are those of the unbroken run).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from splitserve.services.worker_protocol.sampling_params import SamplingParams


@dataclass(slots=True)
class TokenCounts:
    """One sequence's token counts for the penalties, kept up to date by `add`.

    Penalties only change the logits of tokens the sequence has seen, so besides the
    per-token arrays it keeps the list of distinct seen ids: a step gathers and scatters
    just those (at most the vocabulary per row). numpy, not torch: counting one accepted
    token is a few array writes, where torch would pay its per-call overhead."""

    seen: np.ndarray              # [vocab] bool: in the prompt or the output
    output: np.ndarray            # [vocab] float32: occurrences in the output
    seen_ids: np.ndarray          # distinct seen ids in its first `num_seen` entries (grows by doubling)
    num_seen: int

    @classmethod
    def of(cls, token_ids: list[int], num_output_tokens: int, vocab: int) -> TokenCounts:
        """Counts of prompt + output `token_ids`, whose last `num_output_tokens` are output."""
        ids = np.asarray(token_ids, dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < vocab)]
        seen = np.zeros(vocab, dtype=np.bool_)
        seen[ids] = True
        distinct = np.flatnonzero(seen)
        seen_ids = np.zeros(max(64, 2 * len(distinct)), dtype=np.int64)
        seen_ids[:len(distinct)] = distinct
        output_ids = np.asarray(token_ids[len(token_ids) - num_output_tokens:] if num_output_tokens else [],
                                dtype=np.int64)
        output = np.bincount(output_ids[(output_ids >= 0) & (output_ids < vocab)],
                             minlength=vocab).astype(np.float32)
        return cls(seen, output, seen_ids, len(distinct))

    def add(self, token_id: int) -> None:
        """An output token was accepted."""
        if not 0 <= token_id < self.seen.shape[0]:
            return
        self.output[token_id] += 1.0
        if not self.seen[token_id]:
            self.seen[token_id] = True
            if self.num_seen == len(self.seen_ids):
                self.seen_ids = np.concatenate([self.seen_ids, np.zeros_like(self.seen_ids)])
            self.seen_ids[self.num_seen] = token_id
            self.num_seen += 1


@dataclass(slots=True, frozen=True)
class TokenHistory:
    """What a row's controls look at besides its parameters.

    The engine passes `counts` (kept incrementally) and `output_tail`; without them (tests,
    direct callers) both are derived from `token_ids`, which then must be prompt + output."""

    token_ids: list[int]          # prompt + output (only read when counts / output_tail are None)
    num_output_tokens: int        # the last this-many are output (including any before a migration)
    num_generated: int            # tokens this worker's request generated (min_tokens counts these)
    counts: TokenCounts | None = None
    output_tail: list[int] | None = None   # the output's last tokens, enough for the longest bad word

    def tail(self, k: int) -> list[int]:
        """The output's last `k` tokens (fewer when the output is shorter)."""
        if k <= 0:
            return []
        if self.output_tail is not None:
            return self.output_tail[-k:]
        n = min(k, self.num_output_tokens)
        return self.token_ids[len(self.token_ids) - n:] if n else []


def apply_logits_controls(logits: torch.Tensor, params: list[SamplingParams],
                          histories: list[TokenHistory], eos_token_ids: frozenset[int] | set[int]
                          ) -> torch.Tensor:
    """logits: [N, vocab]; returns the controlled logits (a new tensor when any control applies)."""
    logits = _mask_disallowed(logits, params)
    logits = _mask_bad_words(logits, params, histories)
    logits = _mask_early_stops(logits, params, histories, eos_token_ids)
    logits = _add_logit_bias(logits, params)
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if rows:
        logits = _penalized(logits, rows, params, histories)
    return logits


def _mask_disallowed(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """allowed_token_ids: every other token of the row at -inf (one scatter for the batch)."""
    rows: list[int] = []
    cols: list[int] = []
    for i, p in enumerate(params):
        if p.allowed_token_ids:
            rows.extend([i] * len(p.allowed_token_ids))
            cols.extend(p.allowed_token_ids)
    if not rows:
        return logits
    masked = torch.zeros(logits.shape[0], dtype=torch.bool)
    masked[sorted(set(rows))] = True
    keep = ~masked.unsqueeze(1).expand(logits.shape).clone()
    keep[rows, cols] = True
    return logits.masked_fill(~keep.to(logits.device), float("-inf"))


def _mask_bad_words(logits: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory]
                    ) -> torch.Tensor:
    """vLLM's bad words: a word's last token is banned where the output ends with the rest."""
    rows: list[int] = []
    cols: list[int] = []
    vocab = logits.shape[1]
    for i, p in enumerate(params):
        if not p.bad_words:
            continue
        tail = histories[i].tail(max(len(w) for w in p.bad_words) - 1)
        for word in p.bad_words:
            prefix = len(word) - 1
            if prefix > len(tail) or word[-1] >= vocab:
                continue
            if not prefix or tail[len(tail) - prefix:] == word[:prefix]:
                rows.append(i)
                cols.append(word[-1])
    if not rows:
        return logits
    logits = logits.clone()
    logits[rows, cols] = float("-inf")
    return logits


def _mask_early_stops(logits: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory],
                      eos_token_ids) -> torch.Tensor:
    rows: list[int] = []
    cols: list[int] = []
    vocab = logits.shape[1]
    for i, (p, h) in enumerate(zip(params, histories)):
        if h.num_generated >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        for t in stops:
            if t < vocab:
                rows.append(i)
                cols.append(t)
    if not rows:
        return logits
    logits = logits.clone()
    logits[rows, cols] = float("-inf")
    return logits


def _add_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        for t, bias in p.logit_bias.items():
            rows.append(i)
            cols.append(t)
            values.append(bias)
    if not rows:
        return logits
    bias = torch.tensor(values, dtype=logits.dtype, device=logits.device)
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    return logits.index_put(index, bias, accumulate=True)


def _penalized(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
               histories: list[TokenHistory]) -> torch.Tensor:
    """The penalties of `rows`, on the (row, token) pairs they touch only: the tokens each row
    has seen. One gather, the formula on those values, one scatter into a copy of the logits
    (out of place: the raw logits give logprobs)."""
    vocab = logits.shape[1]
    counts = [histories[i].counts if histories[i].counts is not None
              else TokenCounts.of(histories[i].token_ids, histories[i].num_output_tokens, vocab) for i in rows]
    cols_per_row = [c.seen_ids[:c.num_seen] for c in counts]
    cols_per_row = [cols[cols < vocab] for cols in cols_per_row]
    lengths = [len(cols) for cols in cols_per_row]
    if not sum(lengths):
        return logits
    row_ids = np.repeat(np.asarray(rows, dtype=np.int64), lengths)
    cols = np.concatenate(cols_per_row)
    occurrences = np.concatenate([c.output[cols] for c, cols in zip(counts, cols_per_row)])
    per_pair = lambda name: torch.from_numpy(np.repeat(  # noqa: E731
        np.asarray([getattr(params[i], name) for i in rows], dtype=np.float32), lengths))
    # Flat positions: index_select / index_copy on one dimension beat tuple indexing here.
    flat = torch.from_numpy(row_ids * vocab + cols).to(logits.device)
    values = logits.reshape(-1).index_select(0, flat)
    repetition = per_pair("repetition_penalty").to(values)
    # A penalty as small as 5e-324 is valid (> 0) but 0 in float32: a division would give inf (and
    # the sampler's softmax NaN), a masked -inf times 0 NaN. Keep the largest finite value, and -inf.
    divided = (values / repetition).clamp(max=torch.finfo(values.dtype).max)
    values = torch.where(values > 0, divided, torch.where(values.isneginf(), values, values * repetition))
    output = torch.from_numpy(occurrences).to(values)
    values = values - per_pair("frequency_penalty").to(values) * output
    values = values - per_pair("presence_penalty").to(values) * (output > 0).to(values.dtype)
    return logits.reshape(-1).index_copy(0, flat, values).view_as(logits)
