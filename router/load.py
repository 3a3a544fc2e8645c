"""The router's load model: pending prefill tokens and decode blocks per worker.

Updated by the router itself (route, first token, finish) so that a burst of
decisions sees its own effect at once, and corrected from each worker's
reported Stats, which also count what other routers (frontend replicas) sent
there.

What counts (the `kv` cost's two load terms, policies/kv.py):

- pending prefill: a request's uncached prompt tokens, on the worker that
  prefills it, from routing until its first token;
- decode blocks: from its first token until it finishes, the KV blocks the
  request *added* on its decode worker: its prompt's blocks minus the leading
  blocks that worker already held (stored or predicted) when it was routed.
  Shared prefix blocks are not new memory, so a worker running ten requests
  over one cached 64-block prefix carries ten requests' question blocks, not
  ten prefixes; and a request still prefilling is counted once, as prefill
  work, not also as decode memory it does not yet use.

Corrections: a worker reports the blocks its requests hold (`num_used_blocks`,
each shared block once). The router's own share of that is the union of its
active requests' prompt blocks there plus one tail block each (the partial
block, or the first generated token's); whatever the worker holds beyond that
was routed by someone else and is added to its decode blocks as `external`.
Work the router still believes is pending on a worker that reports itself idle
is dropped (a lost finish notification must not pin a worker as busy forever).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestLoad:
    decode_id: str
    prefill_id: str            # the decode worker itself when it prefills locally
    num_prefill_tokens: int    # uncached prompt tokens on the prefill worker
    num_new_blocks: int        # decode blocks it adds on its decode worker (prompt minus held prefix)
    block_hashes: list[bytes]  # the prompt's full blocks, for the worker's in-use union
    routed_at: float           # LoadTracker.clock() when routed
    prefilling: bool = True


@dataclass(slots=True)
class WorkerLoad:
    pending_prefill_tokens: int = 0
    decode_blocks: int = 0         # new blocks of this router's requests past their first token
    external_blocks: int = 0       # blocks the worker reports beyond this router's own requests
    request_ids: set[str] = field(default_factory=set)     # this router's active requests decoding here


_IDLE = WorkerLoad()           # read-only stand-in for a worker with no load recorded


class LoadTracker:
    def __init__(self, stale_after_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self._workers: dict[str, WorkerLoad] = {}
        self._requests: dict[str, RequestLoad] = {}
        self.stale_after_s = stale_after_s
        self.clock = clock               # injected so that tests step it instead of sleeping

    def _w(self, worker_id: str) -> WorkerLoad:
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = WorkerLoad()
        return w

    # -- the router's own view -----------------------------------------------------
    def on_route(self, request_id: str, decode_id: str, prefill_id: str | None, num_prefill_tokens: int,
                 num_new_blocks: int, block_hashes: list[bytes] | None = None) -> None:
        if request_id in self._requests:       # re-routed (migration): the old route's load ends
            self.on_finished(request_id)
        req = RequestLoad(decode_id, prefill_id or decode_id, num_prefill_tokens, num_new_blocks,
                          block_hashes if block_hashes is not None else [], self.clock())
        self._requests[request_id] = req
        self._w(req.prefill_id).pending_prefill_tokens += num_prefill_tokens
        self._w(decode_id).request_ids.add(request_id)

    def on_first_token(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None and req.prefilling:
            req.prefilling = False
            self._w(req.prefill_id).pending_prefill_tokens -= req.num_prefill_tokens
            self._w(req.decode_id).decode_blocks += req.num_new_blocks

    def on_finished(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        w = self._w(req.decode_id)
        w.request_ids.discard(request_id)
        if req.prefilling:
            self._w(req.prefill_id).pending_prefill_tokens -= req.num_prefill_tokens
        else:
            w.decode_blocks -= req.num_new_blocks

    # -- corrections from the workers ----------------------------------------------
    def correct(self, worker_id: str, num_used_blocks: int, num_in_flight: int) -> None:
        w = self._w(worker_id)
        if num_in_flight == 0:
            now = self.clock()
            for rid, req in list(self._requests.items()):
                if worker_id in (req.decode_id, req.prefill_id) and now - req.routed_at > self.stale_after_s:
                    self.on_finished(rid)
        w.external_blocks = max(num_used_blocks - self.own_blocks_in_use(worker_id), 0)

    def own_blocks_in_use(self, worker_id: str) -> int:
        """Blocks this router's active requests hold on the worker: their prompts' union + a tail each."""
        w = self._workers.get(worker_id)
        if w is None or not w.request_ids:
            return 0
        reqs = [self._requests[r] for r in w.request_ids]
        return len(set().union(*(r.block_hashes for r in reqs))) + len(reqs)

    def forget(self, worker_id: str) -> None:
        """The worker left routing: its requests' load ends here (and on their other leg's worker)."""
        for rid in [r for r, req in self._requests.items() if worker_id in (req.decode_id, req.prefill_id)]:
            self.on_finished(rid)
        self._workers.pop(worker_id, None)

    # -- queries -------------------------------------------------------------------
    def pending_prefill_tokens(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return w.pending_prefill_tokens if w else 0

    def decode_blocks(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return w.decode_blocks + w.external_blocks if w else 0

    def columns(self, worker_ids: list[str], block_sizes: list[int] | int) -> tuple[list[int], list[int]]:
        """(pending prefill blocks, decode blocks) of each worker, for scoring every candidate at once.

        Pending prefill tokens are rounded up to blocks of that worker's block size
        (one int: every worker's).
        """
        get = self._workers.get
        loads = [get(w, _IDLE) for w in worker_ids]
        if isinstance(block_sizes, int):
            bs = block_sizes
            pending = [-(-x.pending_prefill_tokens // bs) for x in loads]
        else:
            pending = [-(-x.pending_prefill_tokens // bs) for x, bs in zip(loads, block_sizes)]
        decode = [x.decode_blocks + x.external_blocks for x in loads]
        return pending, decode

    def num_requests(self) -> int:
        return len(self._requests)
