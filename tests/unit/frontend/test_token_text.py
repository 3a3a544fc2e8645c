"""Output text continues the prompt's: the detokenizer and the logprob token pieces
(TokenTexts) read each token after the ones before it, prompt included, so they keep
the space a token decoded alone loses (the random Llama's SentencePiece tokenizer),
and the pieces join up into the streamed text."""

from __future__ import annotations

import pytest

from splitserve.checkpoints.model_source import open_checkpoint
from splitserve.services.text.tokenizer import IncrementalDetokenizer, Tokenizer
from splitserve.services.text.token_text import TokenTexts


@pytest.fixture(scope="module")
def tokenizer(llama_dir) -> Tokenizer:
    return Tokenizer(open_checkpoint(str(llama_dir)))


def test_pieces_join_up_into_the_streamed_text(tokenizer):
    prompt = tokenizer.encode("Once upon a time")
    output = tokenizer.encode("there was a quiet village by the sea", add_special_tokens=False)
    detok = IncrementalDetokenizer.after(tokenizer, prompt)         # the engine's and frontend's text
    streamed = "".join(detok.add(t) for t in output) + detok.flush()
    texts = TokenTexts(tokenizer, prompt)
    pieces = [texts.advance(t) for t in output]
    assert "".join(pieces) == streamed == " there was a quiet village by the sea"
    assert pieces[0] == " there"
    assert tokenizer.decode([output[0]]) == "there"        # what decoding it alone gives


def test_alternatives_are_read_in_the_same_context(tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    [paris] = tokenizer.encode(" Paris", add_special_tokens=False)[-1:]
    texts = TokenTexts(tokenizer, prompt)
    assert texts.text(paris) == texts.text(paris)            # reading does not advance
    first = texts.advance(paris)
    assert first.strip() == "Paris" and first.startswith(" ")


def test_special_tokens_are_skipped_unless_asked_for(tokenizer):
    from splitserve.services.text.stop_checker import StopChecker
    from splitserve.services.worker_protocol.sampling_params import SamplingParams

    prompt = tokenizer.encode("Once upon a time")
    words = tokenizer.encode("the end", add_special_tokens=False)
    (eos,) = tokenizer.eos_token_ids
    output = [*words, eos]
    texts = {}
    for skip in (True, False):
        checker = StopChecker(tokenizer, SamplingParams(max_tokens=8), prompt, skip)
        for t in output:
            checker.add(t)
        checker.finish()
        texts[skip] = checker.detok.text
    assert texts[True] == " the end"
    assert texts[False] == " the end" + tokenizer.decode([eos], skip_special_tokens=False)
    assert tokenizer.decode([eos], skip_special_tokens=False)          # the special token has a text
