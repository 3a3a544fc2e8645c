"""Turn the last-position logits of a batch into next tokens.

First the per-request logits controls (logits_controls.py: min_tokens,
logit_bias, repetition/frequency/presence penalties), then the grammar masks of
structured outputs (grammar.py), for greedy rows too.
Greedy rows take the argmax. Sampling rows apply temperature, then top-k, top-p
and min-p filtering, then draw with the sequence's own `torch.Generator`, so a
seeded request gives the same tokens whatever else shares its batch (and,
with `skip_draws`, on whichever worker it continues after a migration).
Log-probabilities (when asked) are those of the model's distribution before
any filtering or penalty, like OpenAI's `logprobs` (vLLM's default
`raw_logprobs`).
"""

from __future__ import annotations

import torch

from splitserve.services.engine.grammar import apply_masks
from splitserve.services.engine.logits_controls import TokenHistory, apply_logits_controls
from splitserve.services.worker_protocol.outputs import SampledToken
from splitserve.services.worker_protocol.sampling_params import SamplingParams

MIN_TEMPERATURE = 1e-4


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None], histories: list[TokenHistory] | None = None,
           eos_token_ids: frozenset[int] | set[int] = frozenset(), grammars: list | None = None
           ) -> list[SampledToken]:
    """logits: [N, vocab] float32, one row per sequence; `histories` (one per row) are the
    tokens the penalties and min_tokens look at (None: rows without any history);
    `grammars` the rows' grammar.GrammarState (None, or None for a row: unconstrained)."""
    if histories is None:
        histories = [TokenHistory([], 0, 0)] * len(params)
    controlled = apply_logits_controls(logits, params, histories, eos_token_ids)
    if grammars is not None and any(g is not None for g in grammars):
        if controlled is logits:
            controlled = logits.clone()         # the raw logits give the logprobs
        apply_masks(controlled, logits, grammars)
    tokens = controlled.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, dtype=torch.long, device=logits.device)
        probs = _filtered_probs(controlled.index_select(0, rows), [params[i] for i in sampled_rows])
        for j, i in enumerate(sampled_rows):
            tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    token_list = tokens.tolist()
    want_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not want_logprobs:
        return [SampledToken(t) for t in token_list]
    logprobs = torch.log_softmax(logits, dim=-1)
    out = []
    for i, t in enumerate(token_list):
        n = params[i].logprobs
        if n is None:
            out.append(SampledToken(t))
            continue
        top = {}
        if params[i].logprob_token_ids:        # vLLM's logprob_token_ids: these, not the top-n
            named = torch.tensor(params[i].logprob_token_ids, dtype=torch.long, device=logits.device)
            top = dict(zip(params[i].logprob_token_ids, logprobs[i].index_select(0, named).tolist()))
        elif n:
            values, ids = logprobs[i].topk(min(n, logprobs.shape[-1]))   # a vocabulary smaller than n: all
            top = dict(zip(ids.tolist(), values.tolist()))
        out.append(SampledToken(t, float(logprobs[i, t]), top))
    return out


def skip_draws(generator: torch.Generator, num_draws: int, vocab_size: int) -> None:
    """Advance `generator` past `num_draws` draws of `sample` over a `vocab_size` row.

    A draw consumes the same random numbers whatever the probabilities are (one
    exponential per vocabulary entry), so a seeded request can be resumed on
    another worker from its seed and the number of tokens it sampled so far.
    """
    if num_draws:
        uniform = torch.ones(vocab_size)
        for _ in range(num_draws):
            torch.multinomial(uniform, 1, generator=generator)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    # A temperature of 1e-300 is 0 in float32 and would make every logit inf (then NaN); this
    # low, any temperature is argmax but for exact ties, and logits / 1e-4 stay finite.
    logits = logits / temps.clamp(min=MIN_TEMPERATURE).unsqueeze(1)
    if any(p.top_k for p in params):
        vocab = logits.shape[1]
        ks = torch.tensor([p.top_k or vocab for p in params], device=logits.device)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (ks - 1).clamp(max=vocab - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=probs.device)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = mass_before >= top_p.unsqueeze(1)
        drop[:, 0] = False        # a top_p that underflows to 0 (5e-324) must still keep the top token
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=probs.device)
        floor = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)
