"""The text a stream may show so far, and where a stop string ends it.

Text work is the frontend's (vLLM's split): workers stop on token ids and
counts only (EOS, stop token ids, max_tokens, the context limit:
services/engine/engine.py's token_stop_reason) and never decode. This checker turns the tokens the
frontend forwards into text incrementally, finds the first stop string (the
text is cut before it, or after it with `include_stop_str_in_output`), and
holds back text that could still turn out to be the start of a stop string, so
a client never sees part of a stop string that is later cut. Counting tokens
against max_tokens is the caller's (frontend/core.py, text/generate.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field

from splitserve.services.text.tokenizer import IncrementalDetokenizer, Tokenizer
from splitserve.services.worker_protocol.sampling_params import SamplingParams


@dataclass(slots=True)
class StopChecker:
    tokenizer: Tokenizer
    params: SamplingParams
    prompt_ids: InitVar[Sequence[int]] = ()    # the text continues the prompt's (detokenizer context)
    skip_special_tokens: InitVar[bool] = True
    detok: IncrementalDetokenizer = field(init=False)
    emitted: int = 0                  # characters of detok.text already handed out
    final_text: str | None = None     # set when a stop string cut the text
    num_tokens: int = 0               # output tokens added (stop strings wait for min_tokens)
    matched_stop: str | None = None   # the stop string that ended the text

    def __post_init__(self, prompt_ids: Sequence[int], skip_special_tokens: bool) -> None:
        self.detok = IncrementalDetokenizer.after(self.tokenizer, prompt_ids, skip_special_tokens)

    def add(self, token_id: int) -> bool:
        """The next output token; True when it completes a stop string (the request ends
        with FinishReason.STOP, the text where the stop string says)."""
        prev_len = len(self.detok.text)
        self.detok.add(token_id)
        self.num_tokens += 1
        # Like vLLM, a stop string completed before min_tokens does not end the request.
        return bool(self.params.stop) and self.num_tokens >= self.params.min_tokens and \
            self._find_stop_string(prev_len)

    def finish(self) -> None:
        """The request ended: everything left becomes showable."""
        if self.final_text is None:
            self.detok.flush()
            self.final_text = self.detok.text

    def take_text(self) -> str:
        """Text not yet handed out that is safe to show."""
        if self.final_text is not None:
            text = self.final_text
            end = len(text)
        else:
            text = self.detok.text
            hold = max((len(s) for s in self.params.stop), default=1) - 1
            end = len(text) - hold if self.params.stop else len(text)
        if end <= self.emitted:
            return ""
        delta = text[self.emitted:end]
        self.emitted = end
        return delta

    def _find_stop_string(self, prev_len: int) -> bool:
        text = self.detok.text
        best = None
        for s in self.params.stop:
            idx = text.find(s, max(0, prev_len - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return False
        idx, s = best
        self.matched_stop = s
        self.final_text = text[:idx + len(s)] if self.params.include_stop_str_in_output else text[:idx]
        return True
