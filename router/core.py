"""The router proper, independent of transport: index + load + one policy per leg.

`route()` hashes the prompt once per distinct (block size, extra key) among the
candidates, walks the index for overlaps, asks the decode leg's policy for a
decode worker and, for disaggregated deployments, decides whether the prompt is
worth a remote prefill *from the chosen decode worker's overlap* (its uncached
tokens against the threshold) before asking the prefill leg's policy. The
decode worker repeats that check against its own cache when the request
arrives (it is authoritative; the router's view lags by events in flight), so
a prompt goes remote only when both agree.

Every decision is logged at debug level and exported (RouterMetrics).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .index import KvIndex
from .load import LoadTracker
from .metrics import RouterMetrics
from .hashing import block_hashes
from .policies import CandidateTable, Decision, Policy

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class WorkerSpec:
    """How a worker hashes its blocks (from its Describe)."""

    block_size: int = 16
    extra_key: bytes = b""


DEFAULT_SPEC = WorkerSpec()
MAX_CACHED_CHAINS = 1024       # prompts whose hash chains are kept until their request finishes


@dataclass(slots=True, frozen=True)
class RouteDecision:
    decode: Decision
    prefill: Decision | None
    reason: str


class RouterCore:
    def __init__(self, decode_policy: Policy, prefill_policy: Policy, index: KvIndex | None = None,
                 load: LoadTracker | None = None, remote_prefill_threshold: int = 64,
                 metrics: RouterMetrics | None = None):
        self.decode_policy = decode_policy
        self.prefill_policy = prefill_policy
        self.index = index or KvIndex()
        self.load = load or LoadTracker()
        self.remote_prefill_threshold = remote_prefill_threshold
        self.metrics = metrics
        self.specs: dict[str, WorkerSpec] = {}
        self._interned: dict[WorkerSpec, WorkerSpec] = {}
        self._chains: dict[str, tuple[list[int], dict[WorkerSpec, list[bytes]]]] = {}

    def set_spec(self, worker_id: str, spec: WorkerSpec) -> None:
        self.specs[worker_id] = self._interned.setdefault(spec, spec)    # equal specs: one object

    def forget(self, worker_id: str) -> None:
        self.index.clear_worker(worker_id)
        self.load.forget(worker_id)
        self.specs.pop(worker_id, None)

    def _chain(self, request_id: str | None, token_ids: list[int], spec: WorkerSpec) -> list[bytes]:
        """The prompt's hash chain for `spec`, computed once per request (both legs, re-routes)."""
        if request_id is None:
            return block_hashes(token_ids, spec.block_size, spec.extra_key)
        entry = self._chains.get(request_id)
        if entry is None or (entry[0] is not token_ids and entry[0] != token_ids):
            if len(self._chains) >= MAX_CACHED_CHAINS:
                del self._chains[next(iter(self._chains))]
            entry = self._chains[request_id] = (token_ids, {})
        hashes = entry[1].get(spec)
        if hashes is None:
            hashes = entry[1][spec] = block_hashes(token_ids, spec.block_size, spec.extra_key)
        return hashes

    def candidates(self, token_ids: list[int], worker_ids: list[str],
                   request_id: str | None = None) -> tuple[CandidateTable, int]:
        """(candidates, the prompt's number of full blocks for the first worker's block size).

        Overlaps come from one index walk per distinct worker spec; workers the walk
        does not name hold 0 leading blocks.
        """
        if not worker_ids:
            return CandidateTable([], [], [], []), len(token_ids) // DEFAULT_SPEC.block_size
        get_spec = self.specs.get
        specs = [get_spec(w, DEFAULT_SPEC) for w in worker_ids]
        first = specs[0]
        if specs.count(first) == len(specs):              # the usual case: one spec (identity compares)
            hashes = self._chain(request_id, token_ids, first)
            get = self.index.overlaps(hashes).get
            overlap = [get(w, 0) for w in worker_ids]
            block_sizes = [first.block_size] * len(worker_ids)
        else:
            by_spec = {s: self.index.overlaps(self._chain(request_id, token_ids, s)) for s in set(specs)}
            overlap = [by_spec[s].get(w, 0) for w, s in zip(worker_ids, specs)]
            block_sizes = [s.block_size for s in specs]
            hashes = self._chain(request_id, token_ids, first)
        pending, decode = self.load.columns(worker_ids, block_sizes)
        return CandidateTable(list(worker_ids), overlap, pending, decode), len(hashes)

    def route(self, request_id: str, token_ids: list[int], decode_ids: list[str],
              prefill_ids: list[str]) -> RouteDecision | None:
        decode_cands, num_blocks = self.candidates(token_ids, decode_ids, request_id)
        decode = self.decode_policy.choose(num_blocks, decode_cands)
        if decode is None:
            self._chains.pop(request_id, None)
            return None
        dspec = self.specs.get(decode.winner.worker_id, DEFAULT_SPEC)
        uncached_tokens = len(token_ids) - decode.winner.candidate.overlap_blocks * dspec.block_size
        prefill, reason = None, "aggregated"
        if prefill_ids:
            if uncached_tokens < self.remote_prefill_threshold:
                reason = f"local prefill ({uncached_tokens} uncached tokens < {self.remote_prefill_threshold})"
            else:
                prefill_cands, pblocks = self.candidates(token_ids, prefill_ids, request_id)
                prefill = self.prefill_policy.choose(pblocks, prefill_cands)
                reason = "remote prefill" if prefill else "local prefill (no prefill worker)"
        prefill_tokens = uncached_tokens
        if prefill is not None:
            pspec = self.specs.get(prefill.winner.worker_id, DEFAULT_SPEC)
            prefill_tokens = len(token_ids) - prefill.winner.candidate.overlap_blocks * pspec.block_size
        self.load.on_route(request_id, decode.winner.worker_id,
                           prefill.winner.worker_id if prefill else None, max(prefill_tokens, 0),
                           -(-len(token_ids) // dspec.block_size))
        result = RouteDecision(decode, prefill, reason)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s: decode %s; prefill %s; %s", request_id, decode.explain(),
                      prefill.explain() if prefill else "-", reason)
        if self.metrics is not None:
            self.metrics.record("decode", decode)
            if prefill is not None:
                self.metrics.record("prefill", prefill)
        return result

    def on_first_token(self, request_id: str) -> None:
        self.load.on_first_token(request_id)

    def on_finished(self, request_id: str) -> None:
        self.load.on_finished(request_id)
        self._chains.pop(request_id, None)
