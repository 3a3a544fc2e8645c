"""`kv`: prefix overlap against load (DESIGN section 4; Dynamo's KV router cost).

For each candidate worker:

    cost = prefill_weight * max(prompt_blocks - overlap_blocks - tier_credit_blocks, 0)
           + pending_prefill_blocks + decode_blocks

- overlap_blocks: leading blocks of the prompt the worker holds: stored (its
  KV events) or predicted (routed there moments ago and not yet reported;
  index.py);
- pending_prefill_blocks: prompt blocks still to prefill there for requests
  routed before this one (queued or running), i.e. work ahead of this prompt;
- decode_blocks: KV blocks its decoding requests *added* (each request's prompt
  minus the prefix the worker already held, counted from its first token on;
  load.py), plus what the worker reports beyond this router's own requests;
- tier_credit_blocks: the blocks after that overlap which the worker's host or
  disk tier holds, each counted at its tier's credit (RouterCore.tier_credit:
  the share of a recompute that loading it back saves). A block in the host tier
  costs the worker a load, not a prefill, so it is worth almost a device hit but
  not quite: a device hit still wins a tie with a host hit;
- cached_blocks (tie-break only): blocks the worker caches in all, stored or
  predicted, whether this prompt uses them or not.

The lowest cost wins; ties go to the less-loaded worker (pending + decode), then
to the one caching fewer blocks, then the smaller worker id. The cache tie-break
is for a prefix no worker holds (a new tenant) while several workers are
equally idle: it lands where it evicts the least, so tenants spread over the
workers. Before it, every such tie went to the first worker id (in one 8-tenant
run: three tenants on worker-0, one on worker-3), and in a KV pool too small for
all of them that worker evicts its own tenants' prefixes while another's pool
sits half empty. With `temperature` > 0 the winner is sampled with
probability ∝ exp(-normalized cost / temperature) from an RNG seeded at
construction (deterministic tests). Parameters: prefill_weight (default
DEFAULT_PREFILL_WEIGHT = 2), temperature (default 0: always the lowest), seed.

Why these terms, in one unit (a block):
- The first token waits for the prefill work queued ahead on that worker plus
  this prompt's own uncached blocks, so pending prefill blocks and uncached
  blocks are the same kind of cost, time to first token.
- The uncached blocks are also the KV memory this request adds there once it
  decodes (cached blocks are shared, not new), which its own future decode
  blocks would otherwise leave out of the comparison. So an uncached block
  costs 1 (prefill time) + 1 (new memory) = 2, the default weight. This equals
  Dynamo's default (overlap weight 1 on prefill blocks, and the request's new
  blocks added to the worker's decode blocks).
- Only uncached blocks depend on the choice: every block routed to a worker
  that lacks it is extra compute for the whole deployment, while pending work
  is done wherever this request goes. A weight above 2 leans further towards
  reuse (fewer replicas of a prefix, more queueing behind its holder); 0
  ignores the cache (least-loaded).
- Worked example (64-block prefix + 2-block question, weight 2): the prefix's
  holder, busy prefilling another tenant's 66 blocks, costs 2·2 + 66 = 70; an
  idle worker without it costs 2·66 = 132: the request waits for the holder
  (on average half a prefill) rather than computing all 66 blocks afresh. A
  new tenant's prompt (no holder) goes to the idle worker: 132 < 132 + 66.

With temperature 0 the costs are computed over the candidate columns in one
pass that keeps the two smallest keys, and only the winner and runner-up become
objects (the decision is the same as `lowest()` over every scored candidate).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from itertools import repeat

from splitserve.router.policies.base import Candidate, CandidateTable, Decision, Scored, sample

DEFAULT_PREFILL_WEIGHT = 2.0
_LAST = (float("inf"),)          # sorts after every (cost, load, cached, worker id) key


def kv_cost(num_prompt_blocks: int, c: Candidate, prefill_weight: float = DEFAULT_PREFILL_WEIGHT) -> Scored:
    uncached = max(num_prompt_blocks - c.overlap_blocks, 0)
    return Scored(c, prefill_weight * max(uncached - c.tier_credit_blocks, 0) + c.load, uncached)


class KvPolicy:
    name = "kv"

    def __init__(self, prefill_weight: float = DEFAULT_PREFILL_WEIGHT, temperature: float = 0.0,
                 seed: int | None = None):
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
        """`lowest()` over the columns in one pass: keys (cost, load, cached, worker id), the two smallest kept."""
        w = self.prefill_weight
        first = second = _LAST
        i1 = i2 = -1
        cost2 = _LAST[0]                   # the runner-up's cost: anything dearer is out at once
        cached = t.cached_blocks if t.cached_blocks is not None else repeat(0)
        credit = t.tier_credit_blocks if t.tier_credit_blocks is not None else repeat(0.0)
        for i, (wid, o, p, d, c, k) in enumerate(zip(t.worker_ids, t.overlap_blocks, t.pending_prefill_blocks,
                                                      t.decode_blocks, cached, credit)):
            load = p + d
            uncached = nb - o - k
            cost = w * (uncached if uncached > 0 else 0) + load
            if cost > cost2:
                continue
            key = (cost, load, c, wid)
            if key < second:
                if key < first:
                    second, i2, first, i1 = first, i1, key, i
                else:
                    second, i2 = key, i
                cost2 = second[0]
        if i1 < 0:
            return None
        winner = self._scored(nb, t, i1, first[0])
        return Decision(self.name, winner, self._scored(nb, t, i2, second[0]) if i2 >= 0 else None)

    @staticmethod
    def _scored(nb: int, t: CandidateTable, i: int, cost: float) -> Scored:
        c = t[i]
        return Scored(c, cost, max(nb - c.overlap_blocks, 0))
