"""KVSender and KVReceiver over kvtransfer's Connector (TCP or NIXL), for any TP degree.

Each tensor-parallel rank of a worker has its own connector, registered on its own
KV pool (its share of the KV heads) right after the model is loaded, before anyone
can ask for its metadata: rank 0's here, the others in their own processes over the
engine's control pipe (parallel/rank_connector_jobs.py). Each rank's transfer logic is
`RankTransfer` (kvtransfer/rank_transfer.py); a TP=1 engine's transfer is kvtransfer's
`SingleRankTransfer`, and `ConnectorTransfer` extends it on rank 0 of a TP group; the worker calls
it through `BuiltinEngine.build_kv_transfer`.

Prefill side. The decode worker's Prefill call carries the metadata of all its
ranks and their grant; `begin` handshakes on every rank (each keeps a grant for the
decode ranks whose heads overlap its own); each step's layer reports reach rank
0's `on_layer_ready` on the engine thread and the other ranks with the broadcast
batch, and every rank posts the WRITEs of its own heads after each layer (head
slicing to each overlapping decode rank). `finish` waits until rank 0's writes are
done and every other rank reported its writes done, then rank 0 notifies every
decode rank with the first token.

Decode side. `expect` reserves the same block ids on every rank (rank 0 schedules,
so they are identical), each with one sender (the prefill worker's rank 0 notifies
every decode rank, whatever its own TP degree); `wait_complete` resolves once every
rank's notification is in, with rank 0's payload. A failure on any rank fails the
request; `release` and `abandon` end it on every rank.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from dataclasses import dataclass

import torch

from splitserve.kvtransfer import AgentMetadata, Connector, KVLayout, make_connector
from splitserve.kvtransfer.errors import TransferError
from splitserve.kvtransfer.rank_transfer import SingleRankTransfer
from splitserve.kvtransfer.sender_receiver import TransferEndpoint, TransferGrant, TransferTarget
from splitserve.services.engine.parallel import rank_connector_jobs as tp_fanout
from splitserve.services.engine.parallel.rank_connector_jobs import Gathered, RankReceived, RankSent
from splitserve.services.engine.parallel.rank_control import RankControl, RankControlError

log = logging.getLogger(__name__)

SETUP_TIMEOUT_S = 300.0     # a rank's connector setup imports its backend: start-up time, not request time


@dataclass(frozen=True, slots=True)
class RankKVPools:
    """What the connectors need of an engine: the whole model's KV layout, rank 0's KV pool, and
    the other ranks (their control channel; None for one process)."""

    layout: KVLayout
    kv_tensor: torch.Tensor
    tensor_parallel_size: int = 1
    control: RankControl | None = None


def connector_kwargs(backend: str, host: str, token: bytes, advertise_host: str | None = None) -> dict:
    """NIXL picks its own addresses; TCP listens on `host` and tells peers `advertise_host`."""
    return {"token": token, **({"host": host, "advertise_host": advertise_host} if backend == "tcp" else {})}


def build_connector(backend: str, name: str, pools: RankKVPools, host: str, token: bytes = b"",
                    advertise_host: str | None = None) -> Connector:
    """Rank 0's connector with rank 0's KV tensor registered (TCP listens on `host` and tells peers
    `advertise_host`); peers must prove `token` (kvtransfer/auth.py)."""
    layout = pools.layout.with_tp(0, pools.tensor_parallel_size)
    connector = make_connector(backend, tp_fanout.rank_agent_name(name, 0), layout,
                               **connector_kwargs(backend, host, token, advertise_host))
    try:
        connector.register(pools.kv_tensor)
    except BaseException:
        connector.close()
        raise
    return connector


def build_connector_transfer(backend: str, name: str, pools: RankKVPools, host: str,
                             token: bytes = b"", advertise_host: str | None = None) -> SingleRankTransfer:
    """Both halves for this worker: a connector per TP rank, each on its own KV pool."""
    bs = pools.layout.block_size
    connector = build_connector(backend, name, pools, host, token, advertise_host)
    control = pools.control
    if control is None:
        return SingleRankTransfer(connector, bs)
    try:
        metas = control.call_all(tp_fanout.setup, backend, name, pools.layout,
                                 connector_kwargs(backend, host, token, advertise_host), bs,
                                 timeout_s=SETUP_TIMEOUT_S)
    except BaseException:
        control.post_all(tp_fanout.close)
        connector.close()
        raise
    return ConnectorTransfer(connector, bs, control, [AgentMetadata.from_bytes(m) for m in metas])


class ConnectorTransfer(SingleRankTransfer):
    """Both halves, on rank 0 of a tensor-parallel engine, over every rank's connector: rank 0's
    own share is `SingleRankTransfer`'s, and every call also reaches ranks 1..N-1."""

    def __init__(self, connector: Connector, block_size: int, control: RankControl,
                 rank_metadata: list[AgentMetadata]):
        others = tuple(TransferEndpoint(r.name, r.to_bytes(), r.layout_hash.encode(), r.incarnation)
                       for r in rank_metadata)
        super().__init__(connector, block_size, others)
        self._control = control
        self._lock = threading.Lock()
        self._serials = itertools.count(1)          # tells a request's attempts apart in child events
        self._gathered: dict[str, tuple[int, Gathered]] = {}    # receiving: request → (serial, wait)
        self._sending: dict[str, int] = {}                      # sending: request → serial
        self._control.set_event_handler(self._on_rank_event)

    # -- receiver (decode) ------------------------------------------------------------
    def expect(self, request_id: str, block_ids: list[int], ttl_s: float) -> TransferGrant:
        grant = super().expect(request_id, block_ids, ttl_s)
        serial = next(self._serials)
        try:
            deadlines = self._control.call_all(tp_fanout.expect, request_id, list(block_ids), ttl_s, serial)
        except Exception as error:
            self.release(request_id)
            raise TransferError(f"request {request_id}: a tensor-parallel rank cannot reserve its "
                                f"blocks: {error}") from None
        with self._lock:
            self._gathered[request_id] = (serial, Gathered(set(self._control.ranks)))
        return TransferGrant(grant.incarnation, min(grant.deadline_unix, *deadlines))

    async def wait_complete(self, request_id: str) -> bytes:
        with self._lock:
            entry = self._gathered.get(request_id)
        if entry is None:
            raise TransferError(f"request {request_id}: no transfer is expected for it")
        self.local.watch(request_id, entry[1].own)
        return await entry[1].wait()

    def release(self, request_id: str) -> None:
        super().release(request_id)
        with self._lock:
            self._gathered.pop(request_id, None)
        self._control.post_all(tp_fanout.release, request_id)

    def num_open(self) -> int:
        return super().num_open() + sum(self._control.call_all(tp_fanout.num_open, timeout_s=5.0))

    # -- sender (prefill) ---------------------------------------------------------------
    def begin(self, request_id: str, target: TransferTarget, num_prompt_tokens: int) -> None:
        serial = next(self._serials)
        self.local.begin(request_id, target, num_prompt_tokens, notify=True, pending_ranks=set(self._control.ranks))
        with self._lock:
            self._sending[request_id] = serial
        try:
            self._control.call_all(tp_fanout.begin, request_id, target, num_prompt_tokens, serial)
        except Exception as error:
            self.abandon(request_id)
            if isinstance(error, TransferError):
                raise
            raise TransferError(f"request {request_id}: a tensor-parallel rank cannot send: {error}") from None

    async def finish(self, request_id: str, payload: bytes) -> None:
        try:
            await super().finish(request_id, payload)
        finally:
            with self._lock:
                self._sending.pop(request_id, None)

    def abandon(self, request_id: str) -> None:
        super().abandon(request_id)
        with self._lock:
            self._sending.pop(request_id, None)
        self._control.post_all(tp_fanout.abandon, request_id)

    fence_errors = (RankControlError,)

    def fence_others(self, request_id: str, timeout_s: float) -> asyncio.Future[list[bool]]:
        with self._lock:
            self._sending.pop(request_id, None)
        children = asyncio.ensure_future(asyncio.to_thread(
            self._control.call_all, tp_fanout.fence, request_id, timeout_s, timeout_s=timeout_s + 1.0))
        children.add_done_callback(lambda task: task.cancelled() or task.exception())
        return children

    def close(self) -> None:
        """Close rank 0's connector; the other ranks close theirs when the engine stops them."""
        super().close()
        self._control.set_event_handler(None)

    # -- events from the other ranks (a control reader thread; never calls them) --------
    def _on_rank_event(self, rank: int, event: object) -> None:
        if isinstance(event, RankSent):
            with self._lock:
                current = self._sending.get(event.request_id) == event.serial
            if current:
                self.local.rank_reported(event.request_id, rank, event.error)
        elif isinstance(event, RankReceived):
            with self._lock:
                entry = self._gathered.get(event.request_id)
            if entry is not None and entry[0] == event.serial:
                entry[1].rank(rank, event.error)
        else:
            log.warning("KV transfer: unexpected event %r from tensor-parallel rank %d", event, rank)
