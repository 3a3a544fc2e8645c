"""Per-request generation parameters, validated once at the door."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.errors import InvalidRequestError


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
    include_stop_str_in_output: bool = False
    # Draws a seeded request's generator already made elsewhere (tokens sampled before a
    # migration); the engine skips them so the request continues the same random stream.
    num_prior_draws: int = 0

    MAX_LOGPROBS = 20

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
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}")
        if not isinstance(self.num_prior_draws, int) or self.num_prior_draws < 0:
            raise InvalidRequestError(f"num_prior_draws must be an integer >= 0, got {self.num_prior_draws!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
