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
from .policies import Candidate, Decision, Policy

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class WorkerSpec:
    """How a worker hashes its blocks (from its Describe)."""

    block_size: int = 16
    extra_key: bytes = b""


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

    def set_spec(self, worker_id: str, spec: WorkerSpec) -> None:
        self.specs[worker_id] = spec

    def forget(self, worker_id: str) -> None:
        self.index.clear_worker(worker_id)
        self.load.forget(worker_id)
        self.specs.pop(worker_id, None)

    def candidates(self, token_ids: list[int], worker_ids: list[str]) -> tuple[list[Candidate], int]:
        """(candidates, the prompt's number of full blocks for the first worker's block size)."""
        by_spec: dict[WorkerSpec, dict[str, int]] = {}
        num_blocks: dict[WorkerSpec, int] = {}
        out = []
        for wid in worker_ids:
            spec = self.specs.get(wid, WorkerSpec())
            if spec not in by_spec:
                hashes = block_hashes(token_ids, spec.block_size, spec.extra_key)
                by_spec[spec], num_blocks[spec] = self.index.overlaps(hashes), len(hashes)
            bs = spec.block_size
            out.append(Candidate(wid, by_spec[spec].get(wid, 0),
                                 -(-self.load.pending_prefill_tokens(wid) // bs), self.load.decode_blocks(wid)))
        first = self.specs.get(worker_ids[0], WorkerSpec()) if worker_ids else WorkerSpec()
        return out, num_blocks.get(first, len(token_ids) // first.block_size)

    def route(self, request_id: str, token_ids: list[int], decode_ids: list[str],
              prefill_ids: list[str]) -> RouteDecision | None:
        decode_cands, num_blocks = self.candidates(token_ids, decode_ids)
        decode = self.decode_policy.choose(num_blocks, decode_cands)
        if decode is None:
            return None
        dspec = self.specs.get(decode.winner.worker_id, WorkerSpec())
        uncached_tokens = len(token_ids) - decode.winner.candidate.overlap_blocks * dspec.block_size
        prefill, reason = None, "aggregated"
        if prefill_ids:
            if uncached_tokens < self.remote_prefill_threshold:
                reason = f"local prefill ({uncached_tokens} uncached tokens < {self.remote_prefill_threshold})"
            else:
                prefill_cands, pblocks = self.candidates(token_ids, prefill_ids)
                prefill = self.prefill_policy.choose(pblocks, prefill_cands)
                reason = "remote prefill" if prefill else "local prefill (no prefill worker)"
        prefill_tokens = uncached_tokens
        if prefill is not None:
            pspec = self.specs.get(prefill.winner.worker_id, WorkerSpec())
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
