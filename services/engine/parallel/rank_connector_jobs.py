"""The KV transfer on tensor-parallel ranks 1..N-1, and rank 0's view of their results.

What runs where (a worker with --tp N, one process per rank):

- Every rank owns one kvtransfer connector registered on its own KV pool (its
  share of the KV heads), created in its own process by `setup` at worker start
  (each process registers its own memory, as NIXL deployments do per GPU); a rank
  in a pod of its own listens on its own `--host`. Agent
  names are `<worker>` for rank 0 and `<worker>-tp<r>` for the others.
- The functions below run in a child rank's process, called by rank 0 over the
  control connection (services/engine/parallel/rank_control.py); they drive that rank's
  `RankTransfer` (rank_transfer.py).
- Prefill side: `begin` (a blocking call, so the child is ready before the
  request's first step) registers the send on the child; the child's layer hook
  gets each step's `LayerReport`s with the broadcast batch and posts that rank's
  writes after each layer; after the last layer's writes are done the child
  emits `RankSent`, and rank 0, which notifies every decode rank, waits for it.
- Decode side: `expect` reserves the same block ids (rank 0 schedules, so they are
  identical on every rank) and watches for the notification; the child emits
  `RankReceived` when it arrives or fails, and rank 0's `Gathered` completes the
  request once its own and every child's notification are in.
- `abandon` / `release` end a request on the child whatever its state (posted,
  so they stay in order with the next `begin`/`expect` on the same pipe); a
  child's open send also fails at its grant's deadline, so nothing outlives its
  request. `fence` is a call: it answers once the child's writes for the request
  are no longer in flight (a decode worker waits for that before reusing blocks).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from splitserve.kvtransfer import KVLayout, make_connector
from splitserve.kvtransfer.errors import TransferError
from splitserve.services.engine.model.forward_batch import LayerReport
from splitserve.services.engine.parallel.rank_control import RankContext
from splitserve.kvtransfer.sender_receiver import LayerReady

from splitserve.kvtransfer.rank_transfer import RankTransfer, settle
from splitserve.kvtransfer.sender_receiver import TransferTarget


@dataclass(frozen=True, slots=True)
class RankSent:
    """Event: a child rank's writes for `request_id` are all done (or failed with `error`)."""

    request_id: str
    serial: int                      # rank 0's number for this attempt (a request may be retried)
    error: TransferError | None = None


@dataclass(frozen=True, slots=True)
class RankReceived:
    """Event: a child rank's completion notification arrived (or the transfer failed)."""

    request_id: str
    serial: int
    error: TransferError | None = None


def rank_agent_name(name: str, rank: int) -> str:
    return name if rank == 0 else f"{name}-tp{rank}"


# -- run in a child rank's process (RankControl.call / post) ------------------------------
def setup(ctx: RankContext, backend: str, name: str, layout: KVLayout, connector_kwargs: dict,
          block_size: int) -> bytes:
    """Create and register this rank's connector; returns its AgentMetadata bytes. A rank
    started on its own machine (ctx.host) listens there, not on rank 0's address."""
    if ctx.attachment is not None:
        raise TransferError(f"rank {ctx.rank} already has a KV transfer")
    if ctx.host is not None and "host" in connector_kwargs:
        connector_kwargs = {**connector_kwargs, "host": ctx.host, "advertise_host": ctx.advertise_host}
    connector = make_connector(backend, rank_agent_name(name, ctx.rank), layout.with_tp(ctx.rank, ctx.world_size),
                               **connector_kwargs)
    try:
        connector.register(ctx.kv.tensor)
        transfer = RankTransfer(connector, block_size)
    except BaseException:
        connector.close()
        raise
    ctx.attachment = transfer
    ctx.layer_hook = lambda reports: _layer_done(transfer, reports)
    ctx.closers.append(transfer.close)
    return transfer.metadata.to_bytes()


def _layer_done(transfer: RankTransfer, reports: list[LayerReport]):
    def layer_done(layer: int) -> None:
        for r in reports:
            transfer.on_layer_ready(LayerReady(r.request_id, layer, r.first_block, r.block_ids, r.num_tokens))
    return layer_done


def begin(ctx: RankContext, request_id: str, target: TransferTarget, num_prompt_tokens: int,
          serial: int) -> None:
    _transfer(ctx).begin(request_id, target, num_prompt_tokens, notify=False,
                         on_done=lambda _, error: ctx.emit(RankSent(request_id, serial, error)))


def abandon(ctx: RankContext, request_id: str) -> None:
    _transfer(ctx).abandon(request_id)


def fence(ctx: RankContext, request_id: str, timeout_s: float) -> bool:
    """Stop sending `request_id` from this rank; True once none of its writes is in flight."""
    drained = threading.Event()
    errors: list[TransferError] = []

    def done(_, error: TransferError | None) -> None:
        if error is not None:
            errors.append(error)
        drained.set()

    _transfer(ctx).fence(request_id, done)
    return drained.wait(timeout_s) and not errors


def expect(ctx: RankContext, request_id: str, block_ids: list[int], ttl_s: float, serial: int) -> float:
    """Reserve and watch; returns the grant's deadline (wall clock)."""
    transfer = _transfer(ctx)
    grant = transfer.expect(request_id, block_ids, ttl_s)
    transfer.watch(request_id, lambda _, error: ctx.emit(RankReceived(request_id, serial, error)))
    return grant.deadline_unix


def release(ctx: RankContext, request_id: str) -> None:
    _transfer(ctx).release(request_id)


def num_open(ctx: RankContext) -> int:
    return _transfer(ctx).num_open()


def close(ctx: RankContext) -> None:
    transfer, ctx.attachment, ctx.layer_hook = ctx.attachment, None, None
    if isinstance(transfer, RankTransfer):
        transfer.close()


def _transfer(ctx: RankContext) -> RankTransfer:
    if not isinstance(ctx.attachment, RankTransfer):
        raise TransferError(f"tensor-parallel rank {ctx.rank} has no KV transfer")
    return ctx.attachment


# -- rank 0: a request's notifications on every decode rank ----------------------------------
@dataclass(slots=True)
class Gathered:
    """Rank 0's wait for one request's notifications: its own (with the payload) and each child's."""

    pending_ranks: set[int]
    own_done: bool = False
    payload: bytes = b""
    error: TransferError | None = None
    waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def own(self, payload: bytes | None, error: TransferError | None) -> None:
        with self.lock:
            self.own_done = True
            self.payload = payload or b""
            self.error = self.error or error
        self._settle_if_done()

    def rank(self, rank: int, error: TransferError | None) -> None:
        with self.lock:
            self.pending_ranks.discard(rank)
            self.error = self.error or error
        self._settle_if_done()

    def wait(self) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self.lock:
            self.waiter = (loop, future)
        self._settle_if_done()
        return future

    def _settle_if_done(self) -> None:
        with self.lock:
            done = self.error is not None or (self.own_done and not self.pending_ranks)
            waiter = self.waiter if done else None
            if waiter is not None:
                self.waiter = None
        if waiter is not None:
            settle(waiter, self.payload, self.error)
