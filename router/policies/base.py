"""What every routing policy shares: candidates in, a scored, explained decision out.

A policy is split the way Dynamo splits its KV router: scoring (a pure function
from candidates to costs) and picking (lowest cost, or sampling with a
temperature from a seeded RNG). Every decision carries the winner's cost terms
and the runner-up, so it can be logged and exported as a metric label.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True, frozen=True)
class Candidate:
    worker_id: str
    overlap_blocks: int = 0            # leading prompt blocks this worker holds
    pending_prefill_blocks: int = 0    # prefill work queued or running there
    decode_blocks: int = 0             # KV blocks of its active decodes
    cached_blocks: int = 0             # blocks it caches in all (stored or predicted): the tie-break
    tier_credit_blocks: float = 0.0    # blocks after the overlap that its host/disk tiers hold, discounted

    @property
    def load(self) -> int:
        return self.pending_prefill_blocks + self.decode_blocks


class CandidateTable(Sequence[Candidate]):
    """Candidates as parallel columns, the form RouterCore builds for every decision.

    Indexing builds one `Candidate`, so a policy that scores the columns directly
    (kv) materializes only its winner and runner-up; any other policy can treat
    it as a plain sequence of candidates. `cached_blocks` and `tier_credit_blocks`
    may be None: every worker's is 0.
    """

    __slots__ = ("worker_ids", "overlap_blocks", "pending_prefill_blocks", "decode_blocks", "cached_blocks",
                 "tier_credit_blocks")

    def __init__(self, worker_ids: list[str], overlap_blocks: list[int], pending_prefill_blocks: list[int],
                 decode_blocks: list[int], cached_blocks: list[int] | None = None,
                 tier_credit_blocks: list[float] | None = None):
        self.worker_ids = worker_ids
        self.overlap_blocks = overlap_blocks
        self.pending_prefill_blocks = pending_prefill_blocks
        self.decode_blocks = decode_blocks
        self.cached_blocks = cached_blocks
        self.tier_credit_blocks = tier_credit_blocks

    @classmethod
    def of(cls, candidates: Sequence[Candidate]) -> CandidateTable:
        if isinstance(candidates, CandidateTable):
            return candidates
        return cls([c.worker_id for c in candidates], [c.overlap_blocks for c in candidates],
                   [c.pending_prefill_blocks for c in candidates], [c.decode_blocks for c in candidates],
                   [c.cached_blocks for c in candidates], [c.tier_credit_blocks for c in candidates])

    def __len__(self) -> int:
        return len(self.worker_ids)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self.worker_ids)))]
        return Candidate(self.worker_ids[i], self.overlap_blocks[i], self.pending_prefill_blocks[i],
                         self.decode_blocks[i], self.cached_blocks[i] if self.cached_blocks is not None else 0,
                         self.tier_credit_blocks[i] if self.tier_credit_blocks is not None else 0.0)


@dataclass(slots=True, frozen=True)
class Scored:
    candidate: Candidate
    cost: float
    uncached_blocks: int = 0

    @property
    def worker_id(self) -> str:
        return self.candidate.worker_id

    def terms(self) -> str:
        c = self.candidate
        tiers = f" tier_credit={c.tier_credit_blocks:g}" if c.tier_credit_blocks else ""
        return (f"cost={self.cost:g} overlap={c.overlap_blocks}{tiers} uncached={self.uncached_blocks} "
                f"prefill={c.pending_prefill_blocks} decode={c.decode_blocks} cached={c.cached_blocks}")


@dataclass(slots=True, frozen=True)
class Decision:
    policy: str
    winner: Scored
    runner_up: Scored | None

    def explain(self) -> str:
        text = f"{self.policy}: {self.winner.worker_id} ({self.winner.terms()})"
        if self.runner_up is not None:
            text += f"; runner-up {self.runner_up.worker_id} ({self.runner_up.terms()})"
        return text


class Policy(Protocol):
    name: str

    def choose(self, num_prompt_blocks: int, candidates: Sequence[Candidate]) -> Decision | None:
        """The chosen worker among `candidates`, with the reason; None when there are none."""


def lowest(policy: str, scored: list[Scored]) -> Decision | None:
    """Lowest cost wins; ties go to the less-loaded worker, then the one caching fewer blocks, then
    the smaller worker id."""
    if not scored:
        return None
    ranked = sorted(scored, key=lambda s: (s.cost, s.candidate.load, s.candidate.cached_blocks, s.worker_id))
    return Decision(policy, ranked[0], ranked[1] if len(ranked) > 1 else None)


def sample(policy: str, scored: list[Scored], temperature: float, rng: random.Random) -> Decision | None:
    """Sample ∝ exp(-normalized cost / T); T <= 0 is `lowest`. The runner-up is the best other."""
    if temperature <= 0 or len(scored) < 2:
        return lowest(policy, scored)
    costs = [s.cost for s in scored]
    lo, span = min(costs), (max(costs) - min(costs)) or 1.0
    weights = [math.exp(-((c - lo) / span) / temperature) for c in costs]
    winner = rng.choices(scored, weights)[0]
    others = lowest(policy, [s for s in scored if s is not winner])
    return Decision(policy, winner, others.winner if others else None)
