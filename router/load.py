"""The router's load model: pending prefill tokens and active decode blocks per worker.

Updated by the router itself (route, first token, finish) so that a burst of
decisions sees its own effect at once, and corrected from each worker's
reported Stats, which also count what other routers (frontend replicas) sent
there: a worker's decode load is the larger of the two views, and work the
router still believes is pending on a worker that reports itself idle is
dropped (a lost finish notification must not pin a worker as busy forever).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestLoad:
    decode_id: str
    prefill_id: str            # the decode worker itself when it prefills locally
    num_prefill_tokens: int
    num_decode_blocks: int
    prefilling: bool = True
    routed_at: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class WorkerLoad:
    pending_prefill_tokens: int = 0
    decode_blocks: int = 0
    reported_decode_blocks: int = 0


_IDLE = WorkerLoad()           # read-only stand-in for a worker with no load recorded


class LoadTracker:
    def __init__(self, stale_after_s: float = 5.0):
        self._workers: dict[str, WorkerLoad] = {}
        self._requests: dict[str, RequestLoad] = {}
        self.stale_after_s = stale_after_s

    def _w(self, worker_id: str) -> WorkerLoad:
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = WorkerLoad()
        return w

    # -- the router's own view -----------------------------------------------------
    def on_route(self, request_id: str, decode_id: str, prefill_id: str | None, num_prefill_tokens: int,
                 num_decode_blocks: int) -> None:
        if request_id in self._requests:       # re-routed (migration): the old route's load ends
            self.on_finished(request_id)
        req = RequestLoad(decode_id, prefill_id or decode_id, num_prefill_tokens, num_decode_blocks)
        self._requests[request_id] = req
        self._w(req.prefill_id).pending_prefill_tokens += num_prefill_tokens
        self._w(decode_id).decode_blocks += num_decode_blocks

    def on_first_token(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None and req.prefilling:
            req.prefilling = False
            self._w(req.prefill_id).pending_prefill_tokens -= req.num_prefill_tokens

    def on_finished(self, request_id: str) -> None:
        self.on_first_token(request_id)
        req = self._requests.pop(request_id, None)
        if req is not None:
            self._w(req.decode_id).decode_blocks -= req.num_decode_blocks

    # -- corrections from the workers ----------------------------------------------
    def correct(self, worker_id: str, num_used_blocks: int, num_in_flight: int) -> None:
        w = self._w(worker_id)
        w.reported_decode_blocks = num_used_blocks
        if num_in_flight == 0:
            now = time.monotonic()
            for rid, req in list(self._requests.items()):
                if worker_id in (req.decode_id, req.prefill_id) and now - req.routed_at > self.stale_after_s:
                    self.on_finished(rid)

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    # -- queries -------------------------------------------------------------------
    def pending_prefill_tokens(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return w.pending_prefill_tokens if w else 0

    def decode_blocks(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return max(w.decode_blocks, w.reported_decode_blocks) if w else 0

    def columns(self, worker_ids: list[str], block_sizes: list[int]) -> tuple[list[int], list[int]]:
        """(pending prefill blocks, decode blocks) of each worker, for scoring every candidate at once.

        Pending prefill tokens are rounded up to blocks of that worker's block size.
        """
        get = self._workers.get
        loads = [get(w, _IDLE) for w in worker_ids]
        pending = [-(-x.pending_prefill_tokens // bs) for x, bs in zip(loads, block_sizes)]
        decode = [x.decode_blocks if x.decode_blocks >= x.reported_decode_blocks else x.reported_decode_blocks
                  for x in loads]
        return pending, decode

    def num_requests(self) -> int:
        return len(self._requests)
