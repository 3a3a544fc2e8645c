"""The correctness oracle: Hugging Face transformers' greedy output, and how to compare.

DESIGN section 3: the engine's greedy output, in any configuration, must equal
`generate(do_sample=False)` on the same weights in fp32, token for token, except
where the reference's top two logits are within a tolerance; there the two
implementations may legitimately break the tie differently, and everything
after that point depends on the tie-break, so it is not compared.

The reference runs one prompt at a time (no padding, so no attention-mask
subtleties in the oracle itself) and records, for every generated step, the gap
between the largest and second-largest score the choice was made from.
transformers is a test-only dependency and is imported inside the functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

DEFAULT_TIE_TOLERANCE = 1e-3


@dataclass(slots=True)
class GreedyReference:
    """transformers' greedy continuation of one prompt.

    `token_ids` are the generated ids only (not the prompt); when generation
    stopped at EOS the EOS id is the last one, as `generate` returns it.
    `top2_gaps[i]` is largest minus second-largest score at step i (same length
    as `token_ids`).
    """

    token_ids: list[int]
    top2_gaps: list[float]
    stopped_at_eos: bool = False
    prompt_ids: list[int] = field(default_factory=list)


def hf_greedy(
    folder: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    dtype: torch.dtype = torch.float32,
    ignore_eos: bool = False,
    repetition_penalty: float = 1.0,
) -> list[GreedyReference]:
    """Greedy-decode each prompt (token ids) with transformers from the checkpoint in `folder`.

    Stops at the checkpoint's EOS like `generate` does by default, or produces
    exactly `max_new_tokens` tokens when `ignore_eos` (EOS is then masked out,
    via `min_new_tokens`, and never generated). `repetition_penalty` is generate's
    (RepetitionPenaltyLogitsProcessor over prompt + output).
    """
    from transformers import AutoModelForCausalLM

    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    model = AutoModelForCausalLM.from_pretrained(Path(folder), dtype=dtype).eval()
    eos_token_ids = _eos_token_ids(model)
    return [_greedy_one(model, prompt_ids, max_new_tokens, ignore_eos, eos_token_ids, repetition_penalty)
            for prompt_ids in prompts]


def greedy_reference(model, prompt_ids: list[int], max_new_tokens: int, *,
                     ignore_eos: bool = False) -> GreedyReference:
    """`hf_greedy` for one prompt on an already loaded transformers model."""
    return _greedy_one(model, prompt_ids, max_new_tokens, ignore_eos, _eos_token_ids(model))


def _eos_token_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def _greedy_one(model, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool, eos_token_ids: list[int],
                repetition_penalty: float = 1.0):
    if not prompt_ids:
        raise ValueError("empty prompt")
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            repetition_penalty=repetition_penalty,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens if ignore_eos else 0,
            eos_token_id=eos_token_ids or None,
            pad_token_id=eos_token_ids[0] if eos_token_ids else 0,
            # scores are the processed logits the choice was made from (EOS at
            # -inf when ignore_eos); the gaps must come from those.
            output_scores=True,
            return_dict_in_generate=True,
        )
    token_ids = out.sequences[0, len(prompt_ids) :].tolist()
    gaps = [_top2_gap(step_scores[0]) for step_scores in out.scores]
    assert len(gaps) == len(token_ids), (len(gaps), len(token_ids))
    stopped = bool(token_ids) and token_ids[-1] in eos_token_ids and not ignore_eos
    return GreedyReference(token_ids=token_ids, top2_gaps=gaps, stopped_at_eos=stopped, prompt_ids=list(prompt_ids))


def _top2_gap(scores: torch.Tensor) -> float:
    top2 = torch.topk(scores.float(), 2).values
    return float(top2[0] - top2[1])


def assert_greedy_match(ours: list[int], ref: GreedyReference, tie_tolerance: float = DEFAULT_TIE_TOLERANCE) -> int:
    """Assert that `ours` (generated ids) equals the reference token for token.

    At the first differing position, a reference top-2 gap below
    `tie_tolerance` is a tie: the rest is not compared and the check passes.
    Otherwise, and when one sequence is a strict prefix of the other, raises
    AssertionError naming the position, both tokens and the gap. Returns the
    number of positions that matched before the end or the tie.
    """
    ours = list(ours)
    expected = ref.token_ids
    for position, (got, want) in enumerate(zip(ours, expected)):
        if got == want:
            continue
        gap = ref.top2_gaps[position]
        if gap < tie_tolerance:
            return position
        raise AssertionError(
            f"greedy mismatch at generated position {position}: ours {got}, reference {want}, "
            f"reference top-2 gap {gap:.3g} >= tie tolerance {tie_tolerance:g}; "
            f"matching prefix {expected[:position][-8:]} (last 8 shown)"
        )
    if len(ours) != len(expected):
        shorter, longer = ("ours", "reference") if len(ours) < len(expected) else ("reference", "ours")
        raise AssertionError(
            f"greedy length mismatch: ours has {len(ours)} tokens, reference {len(expected)} "
            f"(reference stopped at EOS: {ref.stopped_at_eos}); {shorter} ends where {longer} continues "
            f"with {(expected if longer == 'reference' else ours)[min(len(ours), len(expected)) :][:8]}"
        )
    return len(expected)
