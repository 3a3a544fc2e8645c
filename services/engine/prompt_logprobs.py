"""Prompt logprobs (vLLM's `prompt_logprobs`): how likely the model found each prompt token.

The logits at prompt position p score token p + 1, so a prefill chunk over positions
[start, end) scores tokens start + 1 .. end (the last prompt position scores the first
output token: that is sampling, not this). The model runner asks for those positions'
logits after the sampled rows (model_runner.prompt_logit_positions); this turns them into
one entry per token: its logprob under the model's raw distribution (as the generated
tokens' logprobs, vLLM's default `raw_logprobs`) and the top-n. As vLLM does, the prompt
of such a request is computed without prefix-cache reads (a cached block has no logits):
Sequence.needs_prompt_logits.
"""

from __future__ import annotations

import torch

from splitserve.services.engine.sequence import Sequence
from splitserve.services.worker_protocol.outputs import SampledToken


def score_prompt_tokens(logits: torch.Tensor, spans: list[tuple[Sequence, range]]) -> None:
    """`logits`: [sum of the spans' lengths, vocab], the rows of each span's positions in order;
    appends each position's entry to its sequence's `prompt_logprobs`."""
    offset = 0
    for seq, positions in spans:
        rows = logits[offset:offset + len(positions)]
        offset += len(positions)
        logprobs = torch.log_softmax(rows.float(), dim=-1)
        targets = torch.tensor(seq.prompt_token_ids[positions.start + 1:positions.stop + 1], dtype=torch.long)
        chosen_t = logprobs.gather(1, targets.unsqueeze(1))
        ranks = ((logprobs > chosen_t).sum(dim=1) + 1).tolist()      # vLLM's Logprob.rank
        chosen = chosen_t.squeeze(1).tolist()
        n = min(seq.params.prompt_logprobs or 0, logprobs.shape[1])
        if n:
            values, ids = logprobs.topk(min(n, logprobs.shape[-1]), dim=-1)
            tops = [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        else:
            tops = [{} for _ in positions]
        seq.prompt_logprobs.extend(SampledToken(t, lp, top, rank) for t, lp, top, rank in
                                   zip(targets.tolist(), chosen, tops, ranks))
