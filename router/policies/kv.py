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

With temperature 0 the costs are computed over the candidate columns in one
pass and only the winner and runner-up become objects (the decision is the same
as `lowest()` over every scored candidate).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from .base import Candidate, CandidateTable, Decision, Scored, sample


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
        if self.temperature > 0 and len(candidates) >= 2:
            scored = [kv_cost(num_prompt_blocks, c, self.prefill_weight) for c in candidates]
            return sample(self.name, scored, self.temperature, self.rng)
        return self._lowest(num_prompt_blocks, CandidateTable.of(candidates))

    def _lowest(self, nb: int, t: CandidateTable) -> Decision | None:
        """`lowest()` over the columns: keys (cost, load, worker id), the two smallest kept."""
        if not t.worker_ids:
            return None
        w = self.prefill_weight
        keys = [(w * (nb - o if o < nb else 0) + p + d, p + d, wid)
                for wid, o, p, d in zip(t.worker_ids, t.overlap_blocks, t.pending_prefill_blocks, t.decode_blocks)]
        first = min(keys)
        i = keys.index(first)
        winner = self._scored(nb, t, i, first[0])
        if len(keys) == 1:
            return Decision(self.name, winner, None)
        rest = keys[:i] + keys[i + 1:]
        second = min(rest)
        j = rest.index(second)
        return Decision(self.name, winner, self._scored(nb, t, j if j < i else j + 1, second[0]))

    @staticmethod
    def _scored(nb: int, t: CandidateTable, i: int, cost: float) -> Scored:
        c = t[i]
        return Scored(c, cost, max(nb - c.overlap_blocks, 0))
