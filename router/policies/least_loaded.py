"""`least-loaded`: the candidate with the least pending prefill + decode blocks.

cost = pending_prefill_blocks + decode_blocks; ties to the smaller worker id.
Ignores the prefix cache entirely.
"""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.router.policies.base import Candidate, Decision, Scored, lowest


class LeastLoadedPolicy:
    name = "least-loaded"

    def __init__(self, seed: int | None = None):
        pass

    def choose(self, num_prompt_blocks: int, candidates: Sequence[Candidate]) -> Decision | None:
        return lowest(self.name, [Scored(c, c.load) for c in candidates])
