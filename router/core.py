"""The router proper, independent of transport: index + load + one policy per leg.

`route()` hashes the prompt once per distinct (block size, extra key) among the
candidates, walks the index for overlaps, asks the decode leg's policy for a
decode worker and, for disaggregated deployments, decides whether the prompt is
worth a remote prefill *from the chosen decode worker's overlap* (its uncached
tokens against the threshold) before asking the prefill leg's policy. The
decode worker repeats that check against its own cache when the request
arrives (it is authoritative; the router's view lags by events in flight), so
a prompt goes remote only when both agree.

After a decision the routed prompt's blocks are *predicted* on the chosen
worker(s) in the index (index.py: held until the worker's events confirm them,
or for `prediction_ttl_s` if they never do), so the next request with the same
prefix sees it there before the worker has even finished computing it; and the
request's load counts only the blocks it adds (load.py).

Every decision is logged at debug level and exported (RouterMetrics).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat

from splitserve.router.index import KvIndex
from splitserve.router.load import LoadTracker
from splitserve.router.metrics import RouterMetrics
from splitserve.block_hashes import ChainHasher, salted_key
from splitserve.router.policies import CandidateTable, Decision, Policy

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class WorkerSpec:
    """How a worker hashes its blocks (from its Describe)."""

    block_size: int = 16
    extra_key: bytes = b""


DEFAULT_SPEC = WorkerSpec()
MAX_CACHED_CHAINS = 1024       # prompts whose hash chains are kept until their request finishes
PREDICTION_TTL_S = 10.0        # an unconfirmed prediction's life: far longer than a prefill plus the event's trip
EXPIRE_RUNS_PER_ROUTE = 2      # lapsed predict() runs a decision clears (it adds 1, or 2 with a remote prefill)
# A block in a worker's lower tier counts as this share of a device hit (policies/kv.py): at most
# 1 - load time / recompute time. Measured on the 2-core EPYC, SmolLM2, 720 KiB blocks, one
# thread (the engine's tier stats over a load-back): a block's prefill ~59 ms, a load 0.28 ms from
# the host tier and 0.84 ms from a disk file in the page cache (copy + CRC-32), so ~0.99 for both.
# The defaults stay well below: a GPU recomputes a block far faster than it reads one from disk,
# a disk read can miss the page cache, and a device hit should keep its edge (no load, no churn).
# The shared store: a fetch over loopback TCP measured ~1 ms a SmolLM2 block here (round trip,
# the WRITEs into the staging pool, CRC-32, the copy into the pool), again ~0.98; across hosts a
# network hop, and a fetch may find the block evicted meanwhile: 0.5.
DEFAULT_TIER_CREDIT = {"host": 0.9, "disk": 0.6, "store": 0.5}


@dataclass(slots=True, frozen=True)
class RouteDecision:
    decode: Decision
    prefill: Decision | None
    reason: str


class RouterCore:
    def __init__(self, decode_policy: Policy, prefill_policy: Policy, index: KvIndex | None = None,
                 load: LoadTracker | None = None, remote_prefill_threshold: int = 64,
                 metrics: RouterMetrics | None = None, prediction_ttl_s: float = PREDICTION_TTL_S,
                 clock: Callable[[], float] = time.monotonic, predict: bool = True,
                 tier_credit: dict[str, float] | None = None):
        self.decode_policy = decode_policy
        self.tier_credit = {**DEFAULT_TIER_CREDIT, **(tier_credit or {})}
        self.prefill_policy = prefill_policy
        self.index = index or KvIndex()
        self.load = load or LoadTracker()
        self.remote_prefill_threshold = remote_prefill_threshold
        self.metrics = metrics
        self.prediction_ttl_s = prediction_ttl_s
        self.clock = clock
        self.predict = predict         # off when no leg reads overlaps (no KV events subscribed)
        self.specs: dict[str, WorkerSpec] = {}
        self._interned: dict[WorkerSpec, WorkerSpec] = {}
        self._one_spec: WorkerSpec | None = None     # the spec every known worker has, if they agree
        self._chains: dict[str, tuple[list[int], dict[WorkerSpec, list[bytes]]]] = {}
        self._hash = ChainHasher()

    def set_spec(self, worker_id: str, spec: WorkerSpec) -> None:
        self.specs[worker_id] = self._interned.setdefault(spec, spec)    # equal specs: one object
        self._one_spec = self._agreed_spec()

    def forget(self, worker_id: str) -> None:
        self.index.clear_worker(worker_id)
        self.load.forget(worker_id)
        self.specs.pop(worker_id, None)
        self._one_spec = self._agreed_spec()

    def _agreed_spec(self) -> WorkerSpec | None:
        distinct = set(self.specs.values())
        return distinct.pop() if len(distinct) == 1 else None

    def _chain(self, request_id: str | None, token_ids: list[int], spec: WorkerSpec,
               cache_salt: str = "") -> list[bytes]:
        """The prompt's hash chain for `spec` (salted as the worker will salt it: a request with
        a cache_salt overlaps only its salt's blocks), computed once per request (both legs,
        re-routes; a request's salt does not change)."""
        if request_id is None:
            return self._hash(token_ids, spec.block_size, salted_key(spec.extra_key, cache_salt))
        entry = self._chains.get(request_id)
        if entry is None or (entry[0] is not token_ids and entry[0] != token_ids):
            if len(self._chains) >= MAX_CACHED_CHAINS:
                del self._chains[next(iter(self._chains))]
            entry = self._chains[request_id] = (token_ids, {})
        hashes = entry[1].get(spec)
        if hashes is None:
            hashes = entry[1][spec] = self._hash(token_ids, spec.block_size, salted_key(spec.extra_key, cache_salt))
        return hashes

    def candidates(self, token_ids: list[int], worker_ids: list[str],
                   request_id: str | None = None, cache_salt: str = "") -> tuple[CandidateTable, int]:
        """(candidates, the prompt's number of full blocks for the first worker's block size).

        Overlaps come from one index walk per distinct worker spec; workers the walk
        does not name hold 0 leading blocks. Cached blocks (the kv tie-break) are the
        index's per-worker sizes.
        """
        if not worker_ids:
            return CandidateTable([], [], [], [], []), len(token_ids) // DEFAULT_SPEC.block_size
        specs = self.specs
        first = specs.get(worker_ids[0], DEFAULT_SPEC)
        tiered = self.index.has_lower_tiers()
        credit = None
        if self._one_spec is first and all(map(specs.__contains__, worker_ids)) and not tiered:   # the usual case
            hashes = self._chain(request_id, token_ids, first, cache_salt)
            overlaps = self.index.overlaps(hashes)
            overlap = list(map(overlaps.get, worker_ids, repeat(0))) if overlaps else [0] * len(worker_ids)
            pending, decode = self.load.columns(worker_ids, first.block_size)
        else:
            wspecs = [specs.get(w, DEFAULT_SPEC) for w in worker_ids]
            walk = self._tiered_overlaps if tiered else self.index.overlaps
            by_spec = {s: walk(self._chain(request_id, token_ids, s, cache_salt)) for s in set(wspecs)}
            if tiered:
                overlap = [by_spec[s].get(w, (0, 0.0))[0] for w, s in zip(worker_ids, wspecs)]
                credit = [by_spec[s].get(w, (0, 0.0))[1] for w, s in zip(worker_ids, wspecs)]
            else:
                overlap = [by_spec[s].get(w, 0) for w, s in zip(worker_ids, wspecs)]
            hashes = self._chain(request_id, token_ids, first, cache_salt)
            pending, decode = self.load.columns(worker_ids, [s.block_size for s in wspecs])
        return (CandidateTable(worker_ids, overlap, pending, decode, self.index.num_held(worker_ids), credit),
                len(hashes))

    def _tiered_overlaps(self, hashes: list[bytes]) -> dict[str, tuple[int, float]]:
        """worker id -> (leading blocks on its device, credit for the blocks after them in its tiers)."""
        credit = self.tier_credit
        host, disk, store = credit.get("host", 0.0), credit.get("disk", 0.0), credit.get("store", 0.0)
        return {w: (d, host * (dh - d) + disk * (dhk - dh) + store * (dhks - dhk))
                for w, (d, dh, dhk, dhks) in self.index.tiered_overlaps(hashes).items()}

    def route(self, request_id: str, token_ids: list[int], decode_ids: list[str],
              prefill_ids: list[str], cache_salt: str = "",
              pairs: Callable[[str, str], bool] | None = None) -> RouteDecision | None:
        """`pairs(decode id, prefill id)`: whether that prefill worker can fill that decode worker's
        blocks (the same KV layout); None: any can."""
        now = self.clock()
        self.index.expire(now, EXPIRE_RUNS_PER_ROUTE)
        decode_cands, num_blocks = self.candidates(token_ids, decode_ids, request_id, cache_salt)
        decode = self.decode_policy.choose(num_blocks, decode_cands)
        if decode is None:
            self._chains.pop(request_id, None)
            return None
        dspec = self.specs.get(decode.winner.worker_id, DEFAULT_SPEC)
        uncached_tokens = len(token_ids) - decode.winner.candidate.overlap_blocks * dspec.block_size
        prefill, reason = None, "aggregated"
        if prefill_ids and pairs is not None:
            prefill_ids = [p for p in prefill_ids if pairs(decode.winner.worker_id, p)]
            reason = "local prefill (no prefill worker of its KV layout)" if not prefill_ids else reason
        if prefill_ids:
            if uncached_tokens < self.remote_prefill_threshold:
                reason = f"local prefill ({uncached_tokens} uncached tokens < {self.remote_prefill_threshold})"
            else:
                prefill_cands, pblocks = self.candidates(token_ids, prefill_ids, request_id, cache_salt)
                prefill = self.prefill_policy.choose(pblocks, prefill_cands)
                reason = "remote prefill" if prefill else "local prefill (no prefill worker)"
        self._book(request_id, token_ids, decode, prefill, uncached_tokens, now, cache_salt)
        result = RouteDecision(decode, prefill, reason)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s: decode %s; prefill %s; %s", request_id, decode.explain(),
                      prefill.explain() if prefill else "-", reason)
        if self.metrics is not None:
            self.metrics.record("decode", decode)
            if prefill is not None:
                self.metrics.record("prefill", prefill)
        return result

    def _book(self, request_id: str, token_ids: list[int], decode: Decision, prefill: Decision | None,
              uncached_tokens: int, now: float, cache_salt: str = "") -> None:
        """Apply a decision: predict the prompt on the chosen worker(s) and count the request's load."""
        deadline = now + self.prediction_ttl_s
        prefill_id, prefill_tokens = None, uncached_tokens
        if prefill is not None:
            prefill_id = prefill.winner.worker_id
            pspec = self.specs.get(prefill_id, DEFAULT_SPEC)
            p_overlap = prefill.winner.candidate.overlap_blocks
            prefill_tokens = len(token_ids) - p_overlap * pspec.block_size
            if self.predict:
                self.index.predict(prefill_id, self._chain(request_id, token_ids, pspec, cache_salt)[p_overlap:],
                                   deadline)
        decode_id = decode.winner.worker_id
        dspec = self.specs.get(decode_id, DEFAULT_SPEC)
        d_overlap = decode.winner.candidate.overlap_blocks
        chain = self._chain(request_id, token_ids, dspec, cache_salt)
        if self.predict:
            self.index.predict(decode_id, chain[d_overlap:], deadline)
        num_new_blocks = -(-len(token_ids) // dspec.block_size) - d_overlap
        self.load.on_route(request_id, decode_id, prefill_id, max(prefill_tokens, 0), max(num_new_blocks, 0), chain)

    def expire_predictions(self) -> int:
        """Every lapsed prediction (the frontend calls this periodically, off the request path)."""
        return self.index.expire(self.clock())

    def on_first_token(self, request_id: str) -> None:
        self.load.on_first_token(request_id)

    def on_finished(self, request_id: str) -> None:
        self.load.on_finished(request_id)
        self._chains.pop(request_id, None)
