"""Moving a running request to another decode worker on an operator's word (issue 41):
`splitserve admin migrate`, `POST /admin/migrate`.

A move is a migration (migration.py) that no failure caused. After the delta it has just
forwarded, the frontend stops reading the request's stream, asks that decode worker to suspend
the request (Worker.Suspend: it stops decoding and keeps the KV blocks), and continues the request
on another decode worker with prompt + forwarded tokens, naming the suspended request as the KV's
source (`TokenGenerateRequest.kv_source`): the new worker reads the KV of all but the last token
from there (services/worker/kv/migration_source.py) and computes only that last one, instead of
recomputing the whole context. Where the KV cannot move (an aggregated worker, an engine without
it such as vLLM, a request still prefilling, a transfer that fails) the new worker recomputes the
context: token replay, the same continuation, only slower. Greedy and seeded outputs are the ones
the request would have produced unmoved (the seeded generator skips the draws already made, as
for any migration); the client sees one uninterrupted stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.proto.v1 import worker_pb2

METHOD_KV = "kv"            # the KV moved
METHOD_REPLAY = "replay"    # the new worker recomputed the context
SUSPEND_TIMEOUT_S = 5.0


@dataclass(slots=True, frozen=True)
class MoveResult:
    """What a move did: the answer of POST /admin/migrate."""

    request_id: str
    from_worker: str
    to_worker: str
    method: str                 # METHOD_KV or METHOD_REPLAY
    num_tokens: int             # output tokens forwarded before the move
    seconds_to_next_token: float  # from the decision to the next token forwarded
    replay_reason: str = ""     # why the KV did not move, when it did not

    def to_json(self) -> dict:
        body = {"request_id": self.request_id, "from": self.from_worker, "to": self.to_worker,
                "method": self.method, "num_tokens": self.num_tokens,
                "seconds_to_next_token": round(self.seconds_to_next_token, 6)}
        if self.replay_reason:
            body["replay_reason"] = self.replay_reason
        return body


@dataclass(slots=True)
class MoveOrder:
    """One requested move, from the decision to the next token on the new worker."""

    to_worker: str | None          # None: wherever the router sends it (not back to the source)
    replay: bool = False           # recompute instead of moving the KV (a benchmark's baseline)
    decided_at: float = field(default_factory=time.monotonic)
    result: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    begun: bool = False            # the stream from the source was left
    from_worker: str = ""
    num_tokens: int = 0
    kv_source: worker_pb2.KvSource | None = None
    replay_reason: str = ""

    async def leave(self, worker, attempt_id: str, num_tokens: int) -> None:
        """Stop at the source `worker` (a pool WorkerHandle): suspend the request there so that
        its KV waits to be read, unless replaying; the reason is kept when it cannot."""
        self.begun, self.from_worker, self.num_tokens = True, worker.worker_id, num_tokens
        if self.replay:
            self.replay_reason = "token replay was asked for"
            return
        try:
            reply = await worker.stub.Suspend(worker_pb2.SuspendRequest(request_id=attempt_id),
                                              timeout=SUSPEND_TIMEOUT_S)
        except Exception as exc:      # noqa: BLE001 (the move goes on by replay whatever failed)
            code = getattr(exc, "code", None)
            self.replay_reason = f"the source did not suspend it: {code().name if code else exc}"
            return
        if reply.suspended:
            self.kv_source = worker_pb2.KvSource(worker_id=worker.worker_id, address=worker.address,
                                                 request_id=attempt_id)
        else:
            self.replay_reason = reply.reason

    def arrived(self, request_id: str, to_worker: str, kv_moved: bool) -> None:
        """The new worker's first message."""
        if not self.result.done():
            reason = "" if kv_moved else (self.replay_reason or "the new worker could not read the KV")
            self.result.set_result(MoveResult(request_id, self.from_worker, to_worker,
                                              METHOD_KV if kv_moved else METHOD_REPLAY, self.num_tokens,
                                              time.monotonic() - self.decided_at, reason))

    def ended(self, error: BaseException) -> None:
        if not self.result.done():
            self.result.set_exception(error)


class MoveOffDrainingWorkers:
    """A pool listener (workers/pool.py): when a decode worker that moves KV (`DescribeResponse.moves_kv`)
    says NOT_SERVING, which is how a worker that drains (scale-down, deletion, SIGTERM) says it, its
    running requests move to the other decode workers with their KV at once, instead of finishing
    there within the drain timeout or being cut off at its end and replayed."""

    def __init__(self, move_all_off: Callable[[str], None]) -> None:
        self._move_all_off = move_all_off

    def worker_added(self, worker) -> None:
        pass

    def worker_described(self, worker) -> None:
        pass

    def worker_removed(self, worker) -> None:
        pass

    def worker_draining(self, worker) -> None:
        if worker.info is not None and worker.info.moves_kv:
            self._move_all_off(worker.worker_id)
