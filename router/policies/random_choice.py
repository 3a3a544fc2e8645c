"""`random`: a uniformly random candidate from an RNG seeded at construction.

The winner gets cost 0 and every other candidate cost 1; the runner-up shown is
the next one in worker-id order.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from splitserve.router.policies.base import Candidate, Decision, Scored, lowest


class RandomPolicy:
    name = "random"

    def __init__(self, seed: int | None = None):
        self.rng = random.Random(seed)

    def choose(self, num_prompt_blocks: int, candidates: Sequence[Candidate]) -> Decision | None:
        if not candidates:
            return None
        winner = self.rng.randrange(len(candidates))
        return lowest(self.name, [Scored(c, 0 if i == winner else 1) for i, c in enumerate(candidates)])
