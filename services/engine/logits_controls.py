"""Per-request changes to a batch's logits before sampling: min_tokens, logit_bias, penalties.

vLLM's semantics and order (its v1 sampler): first the processors that can change
the argmax — min_tokens (EOS and stop_token_ids at -inf until that many tokens were
generated) and logit_bias (added to the named tokens) — then the penalties:
repetition over prompt + output (transformers' rule: a seen token's positive logit
is divided by the penalty, a negative one multiplied), frequency (subtracted per
occurrence in the output) and presence (subtracted once if the output holds the
token). Temperature, top-k/top-p/min-p come after, in sampler.py; greedy rows take
the argmax of these controlled logits.

Each control is applied to the whole batch at once (index tensors and one
scatter for the token counts), and skipped entirely when no row asks for it, so a
batch without them pays nothing. A request continued after a migration gets its
earlier output as part of the prompt; `TokenHistory.num_output_tokens` says how
many of the last tokens are output, so the counts are those of the unbroken run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.services.wire.sampling_params import SamplingParams


@dataclass(slots=True, frozen=True)
class TokenHistory:
    """The tokens a row's penalties look at."""

    token_ids: list[int]          # prompt + output
    num_output_tokens: int        # the last this-many are output (including any before a migration)
    num_generated: int            # tokens this worker's request generated (min_tokens counts these)


def apply_logits_controls(logits: torch.Tensor, params: list[SamplingParams],
                          histories: list[TokenHistory], eos_token_ids: frozenset[int] | set[int]
                          ) -> torch.Tensor:
    """logits: [N, vocab]; returns the controlled logits (a new tensor when any control applies)."""
    logits = _mask_early_stops(logits, params, histories, eos_token_ids)
    logits = _add_logit_bias(logits, params)
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if rows:
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        penalized = _penalized(logits.index_select(0, index), [params[i] for i in rows],
                               [histories[i] for i in rows])
        logits = logits.index_copy(0, index, penalized)     # out of place: the raw logits give logprobs
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


def _penalized(logits: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory]
               ) -> torch.Tensor:
    n, vocab = logits.shape
    device = logits.device
    seen = _token_counts([h.token_ids for h in histories], vocab, device) > 0
    output_counts = _token_counts([h.token_ids[len(h.token_ids) - h.num_output_tokens:] if h.num_output_tokens
                                   else [] for h in histories], vocab, device).to(logits.dtype)
    column = lambda name: torch.tensor([getattr(p, name) for p in params],  # noqa: E731
                                       dtype=logits.dtype, device=device).unsqueeze(1)
    repetition = torch.where(seen, column("repetition_penalty"), torch.ones((), dtype=logits.dtype, device=device))
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = logits - column("frequency_penalty") * output_counts
    return logits - column("presence_penalty") * (output_counts > 0).to(logits.dtype)


def _token_counts(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(rows), vocab] occurrences of each token; padding goes to a spare column, dropped."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), max(width, 1)), vocab, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    counts = torch.zeros(len(rows), vocab + 1, dtype=torch.int32)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:, :vocab].to(device)
