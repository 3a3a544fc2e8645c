"""`power-of-two`: two candidates drawn at random (seeded RNG), the less loaded wins.

cost = pending_prefill_blocks + decode_blocks of the two sampled candidates;
the other one is the runner-up; ties to the smaller worker id. With one
candidate it is chosen.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from splitserve.router.policies.base import Candidate, Decision, Scored, lowest


class PowerOfTwoPolicy:
    name = "power-of-two"

    def __init__(self, seed: int | None = None):
        self.rng = random.Random(seed)

    def choose(self, num_prompt_blocks: int, candidates: Sequence[Candidate]) -> Decision | None:
        pair = self.rng.sample(list(candidates), min(2, len(candidates)))
        return lowest(self.name, [Scored(c, c.load) for c in pair])
