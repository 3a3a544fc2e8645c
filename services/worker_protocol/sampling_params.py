"""Per-request generation parameters, validated once at the door.

Penalties, logit_bias, min_tokens, allowed_token_ids and bad_words have vLLM's
meaning and ranges (its `vllm/sampling_params.py`); services/engine/logits_controls.py
applies them. bad_words arrive here as token sequences: the frontend owns the
tokenizer (`bad_word_token_ids`, vLLM's `update_from_tokenizer`), the engine the
vocabulary bound (ids beyond it are refused where the vocabulary is known).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from splitserve.errors import InvalidRequestError


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(slots=True, frozen=True)
class StructuredOutput:
    """A grammar the output must match (services/engine/grammar.py compiles it with xgrammar)."""

    kind: str          # one of STRUCTURED_KINDS
    spec: str          # the JSON schema text ("" for json_object: any JSON object), the regex,
                       # the JSON list of choices, the EBNF grammar, the structural tag JSON


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0          # 0 means greedy
    top_k: int = 0                    # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None       # top-n logprobs per generated token; None: none
    # vLLM's logprob_token_ids: the logprobs of these tokens instead of the top-n (with logprobs).
    logprob_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    # Draws a seeded request's generator already made elsewhere (tokens sampled before a
    # migration); the engine skips them so the request continues the same random stream.
    num_prior_draws: int = 0
    presence_penalty: float = 0.0     # subtracted once from each token the output holds
    frequency_penalty: float = 0.0    # subtracted per occurrence in the output
    repetition_penalty: float = 1.0   # divides positive / multiplies negative logits of seen tokens
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0               # EOS and stop_token_ids are masked until this many
    # The last this-many prompt tokens are output generated before a migration (the new
    # worker gets them as prompt): presence/frequency penalties count them as output.
    num_prior_output_tokens: int = 0
    structured: StructuredOutput | None = None
    allowed_token_ids: list[int] = field(default_factory=list)   # empty: any token may be sampled
    bad_words: list[list[int]] = field(default_factory=list)     # token sequences never to complete
    prompt_logprobs: int | None = None  # top-n logprobs per prompt token; None: none
    # vLLM's cache_salt: prefix-cache blocks are shared only among requests with the same salt.
    # Not a sampling parameter: it travels on the worker request (TokenGenerateRequest /
    # PrefillRequest.cache_salt, the request's KV identity), and rides here inside a process.
    cache_salt: str = ""

    DEFAULT_MAX_LOGPROBS = 20         # vLLM's --max-logprobs default; the engine's config decides
    MAX_WIRE = 2**32 - 1              # counts and token ids travel as uint32
    MAX_PENALTY = 2.0
    MAX_CACHE_SALT = 1024

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= self.MAX_WIRE):
            raise InvalidRequestError(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        if not isinstance(self.num_prior_draws, int) or self.num_prior_draws < 0:
            raise InvalidRequestError(f"num_prior_draws must be an integer >= 0, got {self.num_prior_draws!r}")
        self._validate_controls()
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be a list of non-empty strings")

    def _validate_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -self.MAX_PENALTY <= value <= self.MAX_PENALTY:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise InvalidRequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if not isinstance(self.num_prior_output_tokens, int) or self.num_prior_output_tokens < 0:
            raise InvalidRequestError(
                f"num_prior_output_tokens must be an integer >= 0, got {self.num_prior_output_tokens!r}")
        for token_id, bias in self.logit_bias.items():
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids >= 0, got {token_id!r}")
            if not math.isfinite(bias):
                raise InvalidRequestError(f"logit_bias values must be finite numbers, got {bias!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be token ids >= 0")
        self._validate_token_masks()
        if not isinstance(self.cache_salt, str) or len(self.cache_salt) > self.MAX_CACHE_SALT:
            raise InvalidRequestError(f"cache_salt must be a string of at most {self.MAX_CACHE_SALT} characters")
        if self.structured is not None and self.structured.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                                      f"got {self.structured.kind!r}")

    def _validate_token_masks(self) -> None:
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.allowed_token_ids):
            raise InvalidRequestError("allowed_token_ids must be token ids >= 0")
        for word in self.bad_words:
            if not word or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in word):
                raise InvalidRequestError("each bad word must be a non-empty list of token ids >= 0")
        if self.prompt_logprobs is not None and not (
                isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= self.MAX_WIRE):
            raise InvalidRequestError(f"prompt_logprobs must be an integer >= 0, got {self.prompt_logprobs!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.logprob_token_ids):
            raise InvalidRequestError("logprob_token_ids must be token ids >= 0")
        if self.logprob_token_ids and self.logprobs is None:
            raise InvalidRequestError("logprob_token_ids needs logprobs set")

    def check_logprobs(self, max_logprobs: int, vocab_size: int) -> None:
        """vLLM's --max-logprobs (-1: the whole vocabulary): refuse a request for more."""
        limit = vocab_size if max_logprobs == -1 else max_logprobs
        asked = [("sample logprobs of", "logprobs", self.logprobs or 0),
                 ("prompt logprobs of", "prompt_logprobs", self.prompt_logprobs or 0),
                 ("logprob_token_ids of length", "logprob_token_ids", len(self.logprob_token_ids))]
        for what, name, n in asked:
            if n > limit:        # vLLM's words (its VLLMValidationError names the parameter so)
                raise InvalidRequestError(f"Requested {what} {n}, which is greater than max allowed: {limit} "
                                          f"(parameter={name}, value={n})")

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse token ids the model does not have (the worker knows its vocabulary)."""
        named = [("allowed_token_ids", self.allowed_token_ids), ("logprob_token_ids", self.logprob_token_ids),
                 ("bad_words", [t for word in self.bad_words for t in word])]
        for name, ids in named:
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise InvalidRequestError(f"{name} holds token id {bad[0]}, outside the vocabulary "
                                          f"[0, {vocab_size})")

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
