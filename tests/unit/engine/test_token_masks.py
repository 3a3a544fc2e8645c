"""allowed_token_ids and bad_words in the sampler, and the penalties' incremental counts.

Bad words are checked against transformers' NoBadWordsLogitsProcessor (the same rule as
vLLM's: a word's last token is banned where the sequence ends with its other tokens) row
by row on one batch with mixed parameters; the counts the engine keeps token by token
must give exactly the logits of counts rebuilt from the whole history.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import NoBadWordsLogitsProcessor

from splitserve.errors import InvalidRequestError
from splitserve.services.engine.logits_controls import TokenCounts, TokenHistory, apply_logits_controls
from splitserve.services.engine.sampler import sample
from splitserve.services.worker_protocol.proto_conversion import params_from_proto, params_to_proto
from splitserve.services.worker_protocol.sampling_params import SamplingParams

VOCAB = 32


def test_bad_words_match_transformers_row_by_row():
    rng = random.Random(1)
    torch.manual_seed(1)
    rows = 40
    logits = torch.randn(rows, VOCAB)
    params, histories, expected = [], [], []
    for i in range(rows):
        output = [rng.randrange(4) for _ in range(rng.randrange(0, 6))]     # few ids: prefixes do match
        words = [[rng.randrange(4) for _ in range(rng.randrange(1, 4))] for _ in range(rng.randrange(0, 4))]
        p = SamplingParams(bad_words=words)
        p.validate()
        prompt = [rng.randrange(VOCAB) for _ in range(3)]
        params.append(p)
        histories.append(TokenHistory(prompt + output, len(output), len(output)))
        row = logits[i:i + 1].clone()
        if words:
            # transformers looks at the whole sequence; vLLM (and we) at the output only.
            ids = torch.tensor([output or [VOCAB - 1]])
            row = NoBadWordsLogitsProcessor(words)(ids, row) if output else _first_tokens_only(row, words)
        expected.append(row[0])
    controlled = apply_logits_controls(logits, params, histories, set())
    torch.testing.assert_close(controlled, torch.stack(expected))
    assert int(torch.isinf(controlled).sum()) > rows // 2


def _first_tokens_only(row: torch.Tensor, words: list[list[int]]) -> torch.Tensor:
    """No output yet: only one-token words apply (nothing precedes the next token)."""
    for word in words:
        if len(word) == 1:
            row[0, word[0]] = float("-inf")
    return row


def test_bad_word_prefix_generated_before_a_migration_counts():
    """The tail that bad words check includes output a previous worker generated (given as
    the prompt's last `num_prior_output_tokens`), as the engine hands it over."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 5.0
    params = SamplingParams(bad_words=[[3, 4, 7]], num_prior_output_tokens=1)
    migrated = TokenHistory([9, 9, 3], 2, 1, output_tail=[3, 4])
    assert sample(logits, [params], [None], [migrated])[0].token_id != 7
    unrelated = TokenHistory([9, 9, 5], 2, 1, output_tail=[5, 4])
    assert sample(logits, [params], [None], [unrelated])[0].token_id == 7


def test_allowed_token_ids_confine_greedy_and_sampled_rows():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 3
    allowed = [4, 9, 17]
    params = [SamplingParams(allowed_token_ids=allowed), SamplingParams(),
              SamplingParams(allowed_token_ids=allowed, temperature=1.5)]
    gens = [None, None, torch.Generator().manual_seed(0)]
    controlled = apply_logits_controls(logits, params, [TokenHistory([], 0, 0)] * 3, set())
    assert torch.isfinite(controlled[0]).sum() == 3 and torch.isfinite(controlled[0, allowed]).all()
    assert torch.equal(controlled[1], logits[1])
    assert int(controlled[0].argmax()) == allowed[int(logits[0, allowed].argmax())]
    for _ in range(30):
        out = sample(logits, params, gens, [TokenHistory([], 0, 0)] * 3)
        assert out[0].token_id in allowed and out[2].token_id in allowed


def test_incremental_counts_equal_counts_of_the_whole_history():
    rng = random.Random(3)
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3,
                            num_prior_output_tokens=2)
    prompt = [rng.randrange(VOCAB) for _ in range(10)]       # its last 2 are prior output
    counts = TokenCounts.of(prompt, 2, VOCAB)
    output: list[int] = []
    for _ in range(25):
        logits = torch.randn(1, VOCAB)
        kept = apply_logits_controls(logits, [params], [TokenHistory([], 2 + len(output), len(output), counts)],
                                     set())
        rebuilt = apply_logits_controls(logits, [params], [TokenHistory(prompt + output, 2 + len(output),
                                                                         len(output))], set())
        assert torch.equal(kept, rebuilt)
        token = rng.randrange(VOCAB)
        output.append(token)
        counts.add(token)


def test_new_fields_round_trip_the_wire():
    p = SamplingParams(allowed_token_ids=[3, 1], bad_words=[[5], [6, 7]], prompt_logprobs=2, logprobs=0,
                       logprob_token_ids=[9, 4])
    assert params_from_proto(params_to_proto(p)) == p
    assert params_from_proto(params_to_proto(SamplingParams())).prompt_logprobs is None


@pytest.mark.parametrize("change", [
    dict(allowed_token_ids=[-1]), dict(bad_words=[[]]), dict(bad_words=[[1, -3]]), dict(prompt_logprobs=2**32),
    dict(prompt_logprobs=-1), dict(logprob_token_ids=[3]), dict(logprobs=0, logprob_token_ids=[-2]),
])
def test_bad_token_masks_are_refused(change):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**change).validate()


def test_ids_outside_the_vocabulary_are_refused_with_the_field_named():
    with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[VOCAB]).check_vocab(VOCAB)
    with pytest.raises(InvalidRequestError, match="bad_words"):
        SamplingParams(bad_words=[[1, VOCAB + 5]]).check_vocab(VOCAB)
    SamplingParams(allowed_token_ids=[VOCAB - 1]).check_vocab(VOCAB)
    with pytest.raises(InvalidRequestError, match=f"logprob_token_ids holds token id {VOCAB}"):
        SamplingParams(logprobs=0, logprob_token_ids=[1, VOCAB]).check_vocab(VOCAB)


def test_the_engines_max_logprobs_bounds_every_count_with_vllms_words():
    with pytest.raises(InvalidRequestError, match=r"Requested sample logprobs of 21, which is greater than max "
                                                  r"allowed: 20 \(parameter=logprobs"):
        SamplingParams(logprobs=21).check_logprobs(20, VOCAB)
    with pytest.raises(InvalidRequestError, match="Requested prompt logprobs of 21, which is greater than max allowed"):
        SamplingParams(prompt_logprobs=21).check_logprobs(20, VOCAB)
    SamplingParams(logprobs=VOCAB, prompt_logprobs=VOCAB).check_logprobs(-1, VOCAB)     # -1: the vocabulary
    with pytest.raises(InvalidRequestError, match=f"max allowed: {VOCAB}"):
        SamplingParams(logprobs=VOCAB + 1).check_logprobs(-1, VOCAB)
