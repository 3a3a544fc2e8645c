"""`kv`: prefix overlap against load (DESIGN section 4; Dynamo's KV router cost).

For each candidate worker:

    cost = prefill_weight * max(prompt_blocks - overlap_blocks, 0)
           + pending_prefill_blocks + decode_blocks

- overlap_blocks: leading blocks of the prompt the worker already caches (index walk);
- pending_prefill_blocks: prefill work already queued or running there;
- decode_blocks: KV blocks held by its active decodes.

The lowest cost wins; ties go to the less-loaded worker (pending + decode), then
the smaller worker id. With `temperature` > 0 the winner is sampled with
probability ∝ exp(-normalized cost / temperature) from an RNG seeded at
construction (deterministic tests). Parameters: prefill_weight (default 1.0),
temperature (default 0: always the lowest), seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from .base import Candidate, Decision, Scored, sample


def kv_cost(num_prompt_blocks: int, c: Candidate, prefill_weight: float = 1.0) -> Scored:
    uncached = max(num_prompt_blocks - c.overlap_blocks, 0)
    return Scored(c, prefill_weight * uncached + c.pending_prefill_blocks + c.decode_blocks, uncached)


class KvPolicy:
    name = "kv"

    def __init__(self, prefill_weight: float = 1.0, temperature: float = 0.0, seed: int | None = None):
        if prefill_weight < 0 or temperature < 0:
            raise ValueError("prefill_weight and temperature must be >= 0")
        self.prefill_weight = prefill_weight
        self.temperature = temperature
        self.rng = random.Random(seed)

    def choose(self, num_prompt_blocks: int, candidates: Sequence[Candidate]) -> Decision | None:
        scored = [kv_cost(num_prompt_blocks, c, self.prefill_weight) for c in candidates]
        return sample(self.name, scored, self.temperature, self.rng)
