"""`round-robin`: candidates in turn, ignoring cache and load (the baseline).

The cursor advances once per decision; candidates are taken in worker-id order
so that the rotation does not depend on the order the caller lists them in.
Cost of every candidate is its position after the cursor (the winner is 0).
"""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.router.policies.base import Candidate, Decision, Scored, lowest


class RoundRobinPolicy:
    name = "round-robin"

    def __init__(self, seed: int | None = None):
        self._next = 0

    def choose(self, num_prompt_blocks: int, candidates: Sequence[Candidate]) -> Decision | None:
        ordered = sorted(candidates, key=lambda c: c.worker_id)
        if not ordered:
            return None
        n, start = len(ordered), self._next % len(ordered)
        self._next += 1
        return lowest(self.name, [Scored(c, (i - start) % n) for i, c in enumerate(ordered)])
