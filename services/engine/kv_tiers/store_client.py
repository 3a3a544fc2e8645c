"""The worker's side of the shared block store: a `SharedStore` over gRPC and kvtransfer.

The built-in engine attaches this below its KV tiers (`LLMEngine.attach_store`, `--kv-store HOST:PORT`).
Bytes never touch gRPC: the client has its own kvtransfer connector, registered on a small
host **staging pool** (`STAGING_BYTES` of blocks of the engine's layout), half for fetches and
half for publishes (a step's new blocks beyond the free publish half are not published: counted
as `store_publish_busy`), so that a transfer never reads or writes a block the engine may reuse:

- fetch (engine thread, inside an admission): grant staging blocks, ask the store to WRITE the
  leading blocks it holds into them (`Fetch`), wait for its notification, check each block's
  CRC-32 against the one the publisher computed, copy the verified run into the engine's pool;
- publish (engine thread copies, a background thread sends): copy the blocks a step computed
  into free publish staging blocks, `Offer` their hashes and CRC-32s, WRITE the ones the store
  wants into the slots it granted, notify; the store checks the CRCs before serving them.

A store that cannot be reached, times out or fails a fetch never fails a request: the
blocks are recomputed and the reason counted (`rejections`). After a failure the client
leaves the store alone for a back-off (1 s, doubling to 30 s) and re-attaches, so a store
that restarted (new agent incarnation, empty) is picked up again. After a fetch that failed
while the store may still be alive, the fetch staging blocks are fenced until the grant's
deadline has passed (a late WRITE could still land there). The fault switch (kvtransfer/faults.py,
site `store`) flips a bit of a fetched block before its check, or of a published one after its
CRC was taken (the store's own check then refuses it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable

import grpc
import torch

from splitserve.kvtransfer import AgentMetadata, KVLayout, make_connector
from splitserve.kvtransfer.errors import TransferError
from splitserve.kvtransfer.memory import empty_pool
from splitserve.proto.v1 import kvstore_pb2 as pb
from splitserve.proto.v1 import kvstore_pb2_grpc
from splitserve.discovery import KVSTORE_PREFIX
from splitserve.kvtransfer.block_codec import as_bytes, block_crc
from splitserve.kvtransfer.faults import FaultSwitch
from splitserve.kvtransfer.sender_receiver import LayerReady

from splitserve.services.engine.rank_connectors import connector_kwargs
from splitserve.kvtransfer.rank_transfer import RankTransfer
from splitserve.kvtransfer.sender_receiver import GRANT_GRACE_S, TransferEndpoint, TransferGrant, TransferTarget
from splitserve.tls import PLAINTEXT, TlsConfig

log = logging.getLogger(__name__)

STAGING_BYTES = 64 << 20     # the staging pool: half for fetches, half for publishes (at least 8 blocks)
LOOKUP_TIMEOUT_S = 0.5
# A queue head that waits for free blocks is looked up again every engine step, and an
# admission looks its prompt up twice (can it fit, then admit): the same chain within this
# long is answered from the last reply. A stale answer costs nothing: fetch stops where the
# store's run ends and the rest is computed.
LOOKUP_REUSE_S = 0.25
FETCH_TTL_S = 5.0            # a fetch's grant; its RPC waits as long
PUBLISH_TIMEOUT_S = 10.0
BACKOFF_S = (1.0, 30.0)      # first and longest pause after a failure
ALPHA = 0.2
MAX_REPORTED = 1 << 20       # hashes remembered for a store restart's BlockRemoved


class StoreClient:
    def __init__(self, address: str, layout: KVLayout, backend: str, name: str, host: str = "127.0.0.1",
                 token: bytes = b"", advertise_host: str | None = None, staging_bytes: int = STAGING_BYTES,
                 etcd: list[str] | None = None, etcd_tls: TlsConfig = PLAINTEXT):
        """`address` is HOST:PORT, or "etcd": whatever store is registered under KVSTORE_PREFIX in `etcd`,
        looked up on every (re)attach."""
        self.name = f"{name}-store"
        self.address = address
        self._etcd = list(etcd or ())
        self._etcd_tls = etcd_tls
        if address == "etcd" and not self._etcd:
            raise ValueError("--kv-store etcd needs --etcd (where the store registered)")
        self.block_size = layout.block_size
        self.num_layers = layout.num_layers
        kwargs = connector_kwargs(backend, host, token, advertise_host)
        staging_blocks = max(8, staging_bytes // (2 * layout.num_layers * layout.block_bytes))
        connector = make_connector(backend, self.name, layout, **kwargs)
        try:
            self.staging = empty_pool(layout.pool_shape(staging_blocks), layout.torch_dtype)
            connector.register(self.staging)
        except BaseException:
            connector.close()
            raise
        self.transfer = RankTransfer(connector, layout.block_size)
        self.faults = FaultSwitch.from_env()
        half = staging_blocks // 2
        self._fetch_ids = list(range(half))
        self._publish_free = list(range(half, staging_blocks))
        self._target = ""                        # the HOST:PORT the stub dials
        self._channel: grpc.Channel | None = None
        self._stub: kvstore_pb2_grpc.KVStoreStub | None = None
        self._attach_lock = threading.Lock()
        self._store: AgentMetadata | None = None
        self._lock = threading.Lock()            # _publish_free, _store, counters: engine and publisher threads
        self._serials = itertools.count(1)
        self._down_until = 0.0
        self._backoff = BACKOFF_S[0]
        self._fetch_fenced_until = 0.0
        self.round_trip_s = 1e-3
        self.occupancy = (0, 0)                  # the store's (blocks held, capacity) at the last Lookup
        self._last_lookup: tuple[bytes, bytes, int, float, int] | None = None   # first, last, len, when, held
        self._rejected: Counter = Counter()
        self.counts: Counter = Counter()         # published, fetched, lookups
        # KV events for the router (tier "store"), drained on the engine thread (take_events).
        self._events: list[tuple[str, tuple[bytes, ...]]] = []
        self.on_events: Callable[[], None] | None = None     # SharedStore: events wait (any thread)
        self._reported: set[bytes] = set()       # said stored, not said removed
        self._incarnation = ""                   # the store's, when we last attached
        self._outbox: queue.Queue = queue.Queue()
        self._publisher = threading.Thread(target=self._publish_loop, name=f"{self.name}-publish", daemon=True)
        self._publisher.start()

    # -- connection -------------------------------------------------------------------------
    def _ready(self) -> bool:
        """Attached and not backing off (engine or publisher thread)."""
        if time.monotonic() < self._down_until:
            return False
        if self._store is not None:
            return True
        with self._attach_lock:
            return self._store is not None or self._attach()

    def _dial(self) -> None:
        """Point the stub at the store's address (etcd: the one registered now)."""
        target = self.address
        if target == "etcd":
            from splitserve.discovery.etcd import find_one

            record = asyncio.run(find_one(self._etcd, KVSTORE_PREFIX, self._etcd_tls))
            if record is None:
                raise LookupError(f"no KV store is registered under {KVSTORE_PREFIX} in etcd")
            target = record.address
        if target != self._target:
            if self._channel is not None:
                self._channel.close()
            self._channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 16 << 20)])
            self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
            self._target = target

    def _attach(self) -> bool:
        try:
            self._dial()
            reply = self._stub.Attach(pb.AttachStoreRequest(agent_metadata=self.transfer.metadata.to_bytes()),
                                      timeout=LOOKUP_TIMEOUT_S * 4)
            store = AgentMetadata.from_bytes(reply.agent_metadata)
            self.transfer.connector.add_peer(store)
        except (grpc.RpcError, TransferError, ValueError, LookupError, OSError) as error:
            self._fail("store_unavailable", 0, error)
            return False
        with self._lock:
            self._store = store
            if store.incarnation != self._incarnation:
                if self._reported:               # a new store: what the old one held is gone
                    self._events.append(("removed", tuple(self._reported)))
                    self._reported.clear()
                self._events.append(("stored", ()))     # attached: the router credits this worker
                self._incarnation = store.incarnation
        self._events_waiting()
        log.info("KV store %s: attached at %s (%d blocks)", self.address, self._target, reply.capacity_blocks)
        return True

    def _fail(self, reason: str, num_blocks: int, error: BaseException) -> None:
        self._last_lookup = None
        with self._lock:
            self._rejected[reason] += num_blocks
            self._store = None                   # re-attach after the back-off: the store may have restarted
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_S[1])
        detail = error.details() if isinstance(error, grpc.RpcError) else str(error)
        log.warning("KV store %s: %s (%s); recomputing, next try in %.0f s", self.address, reason, detail,
                    self._down_until - time.monotonic())

    def _succeeded(self) -> None:
        self._backoff = BACKOFF_S[0]

    # -- SharedStore ------------------------------------------------------------------------
    def lookup(self, block_hashes: list[bytes]) -> int:
        if not block_hashes or not self._ready():
            return 0
        # A chain hash names its whole prefix: same first and last hash and length, same chain.
        key = (block_hashes[0], block_hashes[-1], len(block_hashes))
        last = self._last_lookup
        if last is not None and last[:3] == key and time.monotonic() - last[3] < LOOKUP_REUSE_S:
            self.counts["lookups_reused"] += 1
            return last[4]
        start = time.perf_counter()
        try:
            reply = self._stub.Lookup(pb.LookupBlocksRequest(block_hashes=block_hashes[:4096]),
                                      timeout=LOOKUP_TIMEOUT_S)
        except grpc.RpcError as error:
            self._fail("store_unavailable", 0, error)
            return 0
        self.round_trip_s += ALPHA * (time.perf_counter() - start - self.round_trip_s)
        self.counts["lookups"] += 1
        self.occupancy = (reply.blocks_held, reply.capacity_blocks)
        self._succeeded()
        store = self._store
        if reply.num_held and store is not None and reply.incarnation != store.incarnation:
            with self._lock:
                self._store = None               # it restarted since we attached: attach again
            if not self._ready():
                return 0
        self._last_lookup = (*key, time.monotonic(), reply.num_held)
        return reply.num_held

    def fetch(self, block_hashes: list[bytes], block_ids: list[int], pool: torch.Tensor) -> int:
        total, chunk = 0, len(self._fetch_ids)
        while total < len(block_hashes):
            want = min(chunk, len(block_hashes) - total)
            n = self._fetch_chunk(block_hashes[total:total + want], block_ids[total:total + want], pool)
            total += n
            if n < want:
                self._last_lookup = None         # the store holds less than it said: ask again next time
                break
        return total

    def _fetch_chunk(self, hashes: list[bytes], block_ids: list[int], pool: torch.Tensor) -> int:
        if not self._ready() or time.monotonic() < self._fetch_fenced_until:
            return 0
        staging = self._fetch_ids[:len(hashes)]
        rid = f"{self.name}-fetch-{next(self._serials)}"
        landed = threading.Event()
        outcome: list[TransferError | None] = []
        try:
            grant = self.transfer.expect(rid, staging, FETCH_TTL_S)
            self.transfer.watch(rid, lambda _payload, error: (outcome.append(error), landed.set()))
        except TransferError as error:
            self._fail("store_fetch_failed", len(hashes), error)
            return 0
        try:
            reply = self._stub.Fetch(pb.FetchBlocksRequest(
                request_id=rid, agent_name=self.name, block_hashes=hashes, block_ids=staging,
                incarnation=grant.incarnation, deadline_unix=grant.deadline_unix), timeout=FETCH_TTL_S)
            n = reply.num_blocks
            if n and not (landed.wait(FETCH_TTL_S) and outcome[0] is None):
                raise TransferError(f"fetch {rid}: the store answered but its writes did not arrive "
                                    f"({outcome[0] if outcome else 'no notification'})")
        except (grpc.RpcError, TransferError) as error:
            # It may still be writing (a slow store, not a dead one): keep off these blocks until
            # no write of this grant can land.
            self._fetch_fenced_until = time.monotonic() + (grant.deadline_unix - time.time()) + GRANT_GRACE_S
            unavailable = isinstance(error, grpc.RpcError) and error.code() in (
                grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
            self._fail("store_unavailable" if unavailable else "store_fetch_failed", len(hashes), error)
            return 0
        finally:
            self.transfer.release(rid)
        for i in range(n):
            self._inject(staging[i], f"fetched block {hashes[i].hex()[:12]}")
            if block_crc(self.staging, staging[i]) != reply.crcs[i]:
                with self._lock:
                    self._rejected["store_corrupt"] += n - i
                log.warning("KV store %s: block %d of fetch %s fails its checksum; recomputing from it",
                            self.address, i, rid)
                n = i
                break
        if n:
            src = torch.tensor(staging[:n])
            dst = torch.tensor(block_ids[:n], device=pool.device)
            pool.index_copy_(2, dst, self.staging.index_select(2, src).to(pool.device))
            self.counts["fetched"] += n
        self._succeeded()
        return n

    def publish(self, pool: torch.Tensor, blocks: list[tuple[int, bytes]]) -> None:
        if time.monotonic() < self._down_until:
            return
        with self._lock:
            take = min(len(blocks), len(self._publish_free))
            slots = [self._publish_free.pop() for _ in range(take)]
            if take < len(blocks):
                self._rejected["store_publish_busy"] += len(blocks) - take
        if not slots:
            return
        src = torch.tensor([block_id for block_id, _ in blocks[:take]], device=pool.device)
        self.staging.index_copy_(2, torch.tensor(slots), pool.index_select(2, src).cpu())
        self._outbox.put((slots, [h for _, h in blocks[:take]]))

    def _inject(self, slot: int, what: str) -> None:
        """The fault switch's `store=flip`: one bit of staging block `slot` (its first layer's K)."""
        self.faults.flip("store", as_bytes(self.staging[0, 0, slot]), what)

    def take_events(self) -> list[tuple[str, tuple[bytes, ...]]]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def _report(self, stored: list[bytes], removed: list[bytes]) -> None:
        with self._lock:
            if removed:
                self._events.append(("removed", tuple(removed)))
                self._reported.difference_update(removed)
            if stored:
                self._events.append(("stored", tuple(stored)))
                if len(self._reported) < MAX_REPORTED:
                    self._reported.update(stored)
        self._events_waiting()

    def _events_waiting(self) -> None:
        """Tell the engine loop (on_events) that events wait, if any do."""
        callback = self.on_events
        if callback is not None and self._events:
            callback()

    def rejections(self) -> dict[str, int]:
        with self._lock:
            return dict(self._rejected)

    def close(self) -> None:
        self._outbox.put(None)
        self._publisher.join(PUBLISH_TIMEOUT_S)
        self.transfer.close()
        if self._channel is not None:
            self._channel.close()

    # -- publisher thread -------------------------------------------------------------------
    def _publish_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            slots, hashes = item
            try:
                self._publish(slots, hashes)
            except Exception as error:      # never let the thread die: later publishes would stall
                self._fail("store_publish_failed", len(slots), error)
            finally:
                with self._lock:
                    self._publish_free.extend(slots)

    def _publish(self, slots: list[int], hashes: list[bytes]) -> None:
        if not self._ready():
            return
        crcs = [block_crc(self.staging, slot) for slot in slots]
        for slot, block_hash in zip(slots, hashes):
            self._inject(slot, f"published block {block_hash.hex()[:12]}")
        rid = f"{self.name}-publish-{next(self._serials)}"
        offer = pb.OfferBlocksRequest(request_id=rid, agent_name=self.name, block_hashes=hashes, crcs=crcs)
        try:
            try:
                reply = self._stub.Offer(offer, timeout=PUBLISH_TIMEOUT_S)
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                with self._lock:
                    self._store = None           # a store that restarted does not know us: attach again
                if not self._ready():
                    return
                reply = self._stub.Offer(offer, timeout=PUBLISH_TIMEOUT_S)
        except grpc.RpcError as error:
            self._fail("store_unavailable", len(slots), error)
            return
        if not reply.wanted:
            self._report(hashes, list(reply.evicted))      # it holds them all already
            return
        store = self._store
        src = [slots[i] for i in reply.wanted]
        dst = list(reply.slot_ids)
        target = TransferTarget(TransferEndpoint(store.name, store.to_bytes(), store.layout_hash.encode()), dst, 0,
                                TransferGrant(reply.incarnation, reply.deadline_unix))
        sent = threading.Event()
        outcome: list[TransferError | None] = []
        try:
            self.transfer.begin(rid, target, len(dst) * self.block_size, notify=True)
            for layer in range(self.num_layers):
                self.transfer.on_layer_ready(LayerReady(rid, layer, 0, src, len(dst) * self.block_size))
            self.transfer.close_send(rid, b"", lambda _p, error: (outcome.append(error), sent.set()))
        except TransferError as error:
            self.transfer.abandon(rid)
            self._fail("store_publish_failed", len(src), error)
            return
        if not sent.wait(PUBLISH_TIMEOUT_S):
            self.transfer.abandon(rid)
            self._fail("store_publish_failed", len(src), TransferError(f"{rid}: writes did not complete"))
        elif outcome[0] is not None:
            self._fail("store_publish_failed", len(src), outcome[0])
        else:
            self.counts["published"] += len(src)
            self._report(hashes, list(reply.evicted))
            return
        wanted = set(reply.wanted)               # these failed; the rest it held already
        self._report([h for i, h in enumerate(hashes) if i not in wanted], list(reply.evicted))
        self._report([hashes[i] for i in range(len(hashes)) if i not in set(reply.wanted)], list(reply.evicted))
