"""Per-request stop conditions and the text a stream may show so far.

Checks, in order: EOS (unless ignore_eos), stop token ids, stop strings,
max_tokens. Text that could still turn out to be the start of a stop string is
held back, so a client never sees part of a stop string that is later cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field

from splitserve.services.wire.sampling_params import SamplingParams
from splitserve.services.engine.sequence import FinishReason
from splitserve.services.text.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(slots=True)
class StopChecker:
    tokenizer: Tokenizer
    params: SamplingParams
    eos_token_ids: set[int]
    prompt_ids: InitVar[Sequence[int]] = ()    # the text continues the prompt's (detokenizer context)
    detok: IncrementalDetokenizer = field(init=False)
    emitted: int = 0                  # characters of detok.text already handed out
    final_text: str | None = None     # set when a stop string cut the text

    def __post_init__(self, prompt_ids: Sequence[int]) -> None:
        self.detok = IncrementalDetokenizer.after(self.tokenizer, prompt_ids)

    def add(self, token_id: int, num_output_tokens: int) -> FinishReason | None:
        prev_len = len(self.detok.text)
        self.detok.add(token_id)
        p = self.params
        if not p.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if token_id in p.stop_token_ids:
            return FinishReason.STOP
        if p.stop and self._find_stop_string(prev_len):
            return FinishReason.STOP
        if num_output_tokens >= p.max_tokens:
            return FinishReason.LENGTH
        return None

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
        self.final_text = text[:idx + len(s)] if self.params.include_stop_str_in_output else text[:idx]
        return True
