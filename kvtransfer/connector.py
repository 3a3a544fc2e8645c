"""The KV connector API: one abstract `Connector`, one subclass per backend.

Roles. A *receiver* (the decode worker) reserves blocks for a request and hands
the resulting `Reservation` to the *sender* (the prefill worker) inside its
Prefill call; the sender posts one WRITE per layer into those blocks and then a
completion notification carrying a small payload (the first sampled token). A
connector plays both roles; all methods are synchronous, thread-safe and never
block unless their name says wait.

Safety, and where each check happens. A reservation grants (request id,
destination block ids, deadline, receiver incarnation).

- The sender-side connector checks every write against the grant *before*
  posting it: layer and source blocks within its own pool, destination blocks
  within the receiver's registered pool (from its metadata), only blocks of that
  grant, not past the deadline, and only to the incarnation that issued it
  (a restarted receiver has a new incarnation; writes with the old grant are
  refused with `StalePeerError`, never posted with stale addresses).
- TCP: the receiver mediates every byte, so it re-checks each frame against its
  own reservation table before reading the payload into the pool and refuses
  (the sender's handle fails with the receiver's error) without writing.
- NIXL: WRITEs are one-sided RDMA/shared-memory puts; the receiver cannot veto
  bytes, so the sender-side check is the enforcement point for a well-behaved
  sender. The receiver validates on the completion notification (incarnation,
  every written block reserved for that request, deadline) and fails the request
  otherwise, so bytes from a buggy sender are never *accepted*. It cannot stop
  a buggy or malicious sender with a forged grant from writing into registered
  memory: one-sided transfer trusts the peers that hold your metadata.

Receiver-side lifetime: a reservation ends when its notification is taken, when
the owner releases it, when it expires (deadline), or when waiting for it times
out; `active_reservations()` lists the open ones (tests use it as a leak check).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import numpy as np
import torch

from splitserve.kvtransfer import auth
from splitserve.kvtransfer.frames import PROGRESS_MAGIC
from splitserve.kvtransfer.errors import (BlockOutOfRangeError, LayoutMismatchError, NotReservedError, PeerAuthError,
                     ReservationExpiredError, StalePeerError, TransferError, TransferTimeoutError)
from splitserve.kvtransfer.layout import KVLayout
from splitserve.kvtransfer.memory import advise_huge_pages
from splitserve.kvtransfer.metrics import transfer_metrics
from splitserve.kvtransfer.reservations import ReservationTable
from splitserve.kvtransfer.tp_slicing import HeadSlice, head_slice

MAX_NOTIFY_PAYLOAD = 64 * 1024
# AgentMetadata.features of this build: the KVd3 transfer digest (transfer_digest.py), and notes a
# receiver keeps aside while its reservation stays open (post_progress).
DIGEST_STREAM, PROGRESS_NOTES = "digest-stream", "progress-notes"
FEATURES = (DIGEST_STREAM, PROGRESS_NOTES)
_GRANT_CACHE_SIZE = 64           # reservations whose destination-block masks a sender keeps


def block_ids_array(block_ids) -> np.ndarray:
    """Block ids (list, tuple, range or integer array) as a 1-D int64 array; ValueError otherwise."""
    array = np.asarray(block_ids)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ValueError(f"block ids must be a flat sequence of integers, got {array.dtype} {array.shape}")
    return array.astype(np.int64, copy=False)


@dataclass(frozen=True, slots=True)
class AgentMetadata:
    """What a sender needs to write into a receiver; the caller ships it between processes."""

    name: str                        # logical agent name (stable across restarts)
    incarnation: str                 # new for every connector instance
    backend: str                     # "tcp" | "nixl"
    address: str                     # "host:port" (tcp); "" (nixl: inside agent_blob)
    layout: KVLayout
    layout_hash: str
    num_blocks: int
    layer_base_addrs: tuple[int, ...]   # address of each layer's region (layout.py: K then V, or pages)
    device: str                      # "cpu" | "cuda:N"
    agent_blob: bytes = b""          # backend agent metadata (NIXL get_agent_metadata())
    auth: bytes = b""                # HMAC tag of the fields above under the transfer token (auth.py)
    # What this agent understands beyond the first protocol (FEATURES); a sender uses only those.
    # Not signed, so that agents from before it still verify the tag: dropping one only
    # makes a sender fall back to what every receiver understands.
    features: tuple[str, ...] = ()

    def to_bytes(self) -> bytes:
        values = asdict(self)
        values["agent_blob"] = base64.b64encode(self.agent_blob).decode()
        values["auth"] = base64.b64encode(self.auth).decode()
        return json.dumps(values).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> AgentMetadata:
        values = json.loads(data)
        layout_fields = {f.name for f in dataclasses.fields(KVLayout)}
        values["layout"] = KVLayout(**{k: v for k, v in values["layout"].items() if k in layout_fields})
        values["layer_base_addrs"] = tuple(values["layer_base_addrs"])
        values["agent_blob"] = base64.b64decode(values["agent_blob"])
        values["auth"] = base64.b64decode(values.get("auth", ""))
        values["features"] = tuple(values.get("features", ()))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})   # a later agent's fields are ignored

    def signed_fields(self) -> tuple:
        """What the auth tag covers: everything a sender trusts when it writes into this agent."""
        return (self.name, self.incarnation, self.backend, self.address, self.layout_hash, self.num_blocks,
                ",".join(map(str, self.layer_base_addrs)), self.device, hashlib.sha256(self.agent_blob).digest())


@dataclass(frozen=True, slots=True)
class Reservation:
    """A receiver's grant: `request_id` may write `block_ids` of `agent_name`/`incarnation` until `deadline_unix`."""

    request_id: str
    agent_name: str
    incarnation: str
    block_ids: tuple[int, ...]
    deadline_unix: float             # wall clock (time.time()); the receiver enforces its own monotonic copy


@dataclass(slots=True, eq=False)
class TransferHandle:
    """One posted write or notification. Poll it through its connector."""

    request_id: str
    peer: str
    kind: str                        # "write" | "notify" | "progress"
    layer: int                       # -1 for a notification
    num_bytes: int
    posted_at: float                 # time.monotonic()
    deadline: float                  # posted_at + the connector's timeout
    backend_state: object = None
    done: bool = False
    error: TransferError | None = None
    counted: bool = field(default=False, repr=False)
    done_at: float = 0.0             # time.monotonic() when a poll first saw it done (remotely complete)

    @property
    def finished(self) -> bool:
        return self.done or self.error is not None


class Connector(ABC):
    """Moves one layer's KV blocks between workers' pools; see the module docstring."""

    backend: ClassVar[str]

    def __init__(self, name: str, layout: KVLayout, *, timeout_s: float = 10.0, clock_margin_s: float = 0.05,
                 registry=None, token: bytes = b"", coalesce: bool = True):
        """`coalesce`: move each run of consecutive blocks as one span (tp_slicing.py); False moves
        one span per block, for comparison (bench/kvtransfer.py). May be changed between writes."""
        self.name = name
        self.coalesce = coalesce
        self.token = token                       # the deployment's shared secret (auth.py); b"": none
        self.layout = layout
        self.timeout_s = timeout_s
        self.clock_margin_s = clock_margin_s     # sender stops this long before a grant's deadline
        self.incarnation = uuid.uuid4().hex
        self.metrics = transfer_metrics(registry)
        self.pool: torch.Tensor | None = None
        self._table: ReservationTable | None = None
        self._peers: dict[str, AgentMetadata] = {}
        self._written: dict[tuple[str, str], list[np.ndarray]] = {}   # (peer, request) → dst blocks posted
        # id(reservation) → (reservation, bool mask over the peer's blocks): the grant check is one
        # gather per write instead of building a set of the grant's blocks every layer.
        self._grant_masks: OrderedDict[int, tuple[Reservation, np.ndarray]] = OrderedDict()
        self._head_slices: dict[str, HeadSlice | None] = {}      # peer incarnation → heads that move
        self._metric_children: dict[tuple, object] = {}         # (metric, labels) → labelled child
        self._lock = threading.RLock()

    # -- setup and handshake --------------------------------------------------------------
    def register(self, pool: torch.Tensor) -> None:
        """Register the local pool, shaped `layout.pool_shape(num_blocks)` (either layout, layout.py).

        Must be called once, before `metadata()`. Raises ValueError if the tensor does
        not match this connector's layout or is not contiguous.
        """
        if self.pool is not None:
            raise ValueError("a pool is already registered")
        num_blocks = self.layout.num_blocks_in(tuple(pool.shape))
        if tuple(pool.shape) != self.layout.pool_shape(num_blocks) or pool.dtype != self.layout.torch_dtype:
            raise ValueError(f"pool {tuple(pool.shape)} {pool.dtype} does not match layout "
                             f"{self.layout.pool_shape(num_blocks)} {self.layout.torch_dtype}")
        if not pool.is_contiguous():
            raise ValueError("the KV pool must be contiguous")
        self.pool = pool
        advise_huge_pages(pool)          # CPU pools: fewer, larger pages to pin and walk (see memory.py)
        self._table = ReservationTable(num_blocks, self.incarnation)
        self._register(pool)

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks_in(tuple(self._require_pool().shape))

    @abstractmethod
    def metadata(self) -> AgentMetadata:
        """This agent's metadata, for peers' `add_peer`. Only after `register`."""

    def add_peer(self, meta: AgentMetadata) -> None:
        """Handshake with a receiver. Raises LayoutMismatchError naming the differing fields.

        Same name and incarnation: no-op. Same name, new incarnation (the peer restarted):
        the stale metadata is dropped and replaced; grants of the old incarnation are refused.
        """
        if not auth.verify(self.token, meta.auth, *meta.signed_fields()):
            self._count_failure(PeerAuthError)
            raise PeerAuthError(f"peer {meta.name} did not present this deployment's transfer token "
                                "(--transfer-token / SPLITSERVE_TRANSFER_TOKEN); its metadata was refused")
        if meta.backend != self.backend:
            raise LayoutMismatchError(f"peer {meta.name} uses backend {meta.backend!r}, this agent {self.backend!r}")
        if meta.layout_hash != self.layout.layout_hash() or self.layout.compare(meta.layout):
            self._count_failure(LayoutMismatchError)
            raise LayoutMismatchError(f"peer {meta.name} has a different KV layout "
                                      f"({self.layout.describe_mismatch(meta.layout) or 'layout hash'}); "
                                      "it serves a different model or configuration")
        with self._lock:
            old = self._peers.get(meta.name)
            if old is not None and old.incarnation == meta.incarnation:
                return
            if old is not None:
                self._remove_peer(old)
            self._add_peer(meta)
            self._peers[meta.name] = meta

    def _sign(self, meta: AgentMetadata) -> AgentMetadata:
        """`meta` with its auth tag under this agent's token (backends' `metadata()` return this)."""
        return dataclasses.replace(meta, auth=auth.tag(self.token, *meta.signed_fields()), features=FEATURES)

    def peer(self, name: str) -> AgentMetadata | None:
        """The current metadata of peer `name`; None if it was never added or was removed."""
        return self._peers.get(name)

    def remove_peer(self, name: str) -> None:
        with self._lock:
            old = self._peers.pop(name, None)
            if old is not None:
                self._remove_peer(old)

    # -- sender side ----------------------------------------------------------------------
    def write_layer(self, reservation: Reservation, layer: int, src_block_ids: list[int],
                    dst_block_ids: list[int]) -> TransferHandle:
        """Post one layer's K and V of `src_block_ids` into the peer's `dst_block_ids`; returns at once.

        The i-th source block goes to the i-th destination block. Raises a TransferError
        (nothing posted) when the grant does not allow it. The source blocks must not
        change until the handle is done.
        """
        src, dst = block_ids_array(src_block_ids), block_ids_array(dst_block_ids)
        try:
            peer = self._peer_for(reservation)
            hs = self._check_write(peer, reservation, layer, src, dst)
        except TransferError as error:
            self._count_failure(type(error))
            raise
        with self._lock:
            self._written.setdefault((peer.name, reservation.request_id), []).append(dst)
        return self._post_write(peer, reservation, layer, src, dst, hs)

    def notify(self, reservation: Reservation, payload: bytes = b"") -> TransferHandle:
        """Post the request's completion notification (after all its writes); returns at once.

        It is delivered only after every write this connector posted for the request has
        completed; if one failed, the notification fails with that error.
        """
        peer = self._notified_peer(reservation, payload)
        with self._lock:
            posted = self._written.pop((peer.name, reservation.request_id), [])
        written = tuple(np.unique(np.concatenate(posted)).tolist()) if posted else ()
        return self._post_notify(peer, reservation, written, payload)

    def post_progress(self, reservation: Reservation, payload: bytes) -> TransferHandle:
        """Post a progress note for the request (its first layers landed, say); returns at once.

        Unlike `notify` it ends nothing and waits for no write: the receiver's owner takes it
        with `take_progress` while the reservation stays open. Send it only to a peer whose
        metadata names the "progress-notes" feature.
        """
        payload = PROGRESS_MAGIC + payload
        return self._post_notify(self._notified_peer(reservation, payload), reservation, (), payload, progress=True)

    def _notified_peer(self, reservation: Reservation, payload: bytes) -> AgentMetadata:
        """The grant's receiver, if a notification of `payload` may go to it now."""
        if len(payload) > MAX_NOTIFY_PAYLOAD:
            raise ValueError(f"notification payload of {len(payload)} bytes exceeds {MAX_NOTIFY_PAYLOAD}")
        try:
            peer = self._peer_for(reservation)
            self._check_deadline(reservation)
        except TransferError as error:
            self._count_failure(type(error))
            raise
        return peer

    def poll(self, handle: TransferHandle) -> bool:
        """True when done, False while in flight; raises the handle's TransferError on failure."""
        if not handle.finished:
            self._check(handle)
        if not handle.finished and time.monotonic() > handle.deadline:
            self._abandon(handle)
            handle.error = TransferTimeoutError(
                f"request {handle.request_id}: {handle.kind} to {handle.peer} did not complete "
                f"within {self.timeout_s:.1f} s")
        if handle.finished and not handle.counted:
            self._count(handle)
        if handle.error is not None:
            raise handle.error
        return handle.done

    def wait(self, handle: TransferHandle) -> None:
        """Block until done; raises its TransferError (TransferTimeoutError past the timeout)."""
        while not self.poll(handle):
            self._wait_once(handle, max(0.0, handle.deadline - time.monotonic()) + 1e-3)

    def forget_request(self, request_id: str) -> None:
        """Sender side: drop bookkeeping of a cancelled request (its posted writes still complete)."""
        with self._lock:
            for key in [k for k in self._written if k[1] == request_id]:
                del self._written[key]

    # -- receiver side --------------------------------------------------------------------
    def reserve(self, request_id: str, block_ids: list[int], ttl_s: float, num_senders: int = 1) -> Reservation:
        """Grant `request_id` writes into `block_ids` for `ttl_s` seconds.

        `num_senders`: how many sending TP ranks write into these blocks; the request is
        complete when each has notified (the payload is the first non-empty one).

        Raises BlockOutOfRangeError for ids outside the pool, ValueError if the request already
        holds a reservation or a block is reserved for another open request.
        """
        table = self._require_table()
        table.reserve(request_id, list(block_ids), ttl_s, num_senders)
        return Reservation(request_id, self.name, self.incarnation, tuple(block_ids), time.time() + ttl_s)

    def release(self, request_id: str) -> bool:
        """End the request's reservation in any state (done, failed, cancelled). False if none."""
        return self._require_table().release(request_id)

    def active_reservations(self) -> dict[str, tuple[int, ...]]:
        """Open reservations: request id → block ids. Empty when nothing leaks."""
        self._progress()
        return self._require_table().active()

    def take_progress(self, request_id: str) -> list[bytes]:
        """The progress notes (`post_progress` payloads) that arrived for the request since the last
        call, oldest first; [] for an unknown or ended request. Does not drive the backend:
        `progress` or `poll_notification` does."""
        return self._require_table().take_progress(request_id)

    def poll_notification(self, request_id: str) -> bytes | None:
        """The notification payload once it arrived (the reservation then ends), None while open.

        Raises the request's TransferError if it failed (expired, refused notification, sender
        lost), and NotReservedError for an unknown request id; both end the reservation.
        """
        self._progress()
        return self._require_table().take_result(request_id)

    def wait_notification(self, request_id: str, timeout_s: float | None = None) -> bytes:
        """Block until the notification (payload returned) or a failure (raised).

        Past `timeout_s` (default: the connector's timeout) raises TransferTimeoutError and
        releases the reservation. An expired reservation raises ReservationExpiredError sooner.
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        while True:
            payload = self.poll_notification(request_id)
            if payload is not None:
                return payload
            left = start + timeout_s - time.monotonic()
            if left <= 0:
                raise self._require_table().time_out(request_id, timeout_s)
            self._wait_notification_once(min(left, 0.05))

    def progress(self) -> None:
        """Drive the backend without blocking; call it regularly from the owner's loop.

        NIXL runs without a progress thread, so a receiver that never polls stalls
        rendezvous WRITEs aimed at it; TCP does its I/O in its own thread (no-op).
        """
        self._progress()

    def close(self) -> None:
        """Stop background work and deregister memory. Idempotent."""

    def cached_peer_state(self) -> list[tuple[str, str]]:
        """(peer name, incarnation) of each peer the backend holds state for (connections, prepared
        descriptor lists). After `add_peer` with a restarted peer's metadata, the old incarnation
        is gone from it: nothing stale is kept to be written through."""
        return []

    # -- backend hooks ---------------------------------------------------------------------
    @abstractmethod
    def _register(self, pool: torch.Tensor) -> None: ...

    @abstractmethod
    def _add_peer(self, meta: AgentMetadata) -> None: ...

    @abstractmethod
    def _remove_peer(self, meta: AgentMetadata) -> None: ...

    @abstractmethod
    def _post_write(self, peer: AgentMetadata, reservation: Reservation, layer: int, src_block_ids: np.ndarray,
                    dst_block_ids: np.ndarray, hs: HeadSlice) -> TransferHandle:
        """Post a checked write; block ids are int64 arrays (see `block_ids_array`)."""

    @abstractmethod
    def _post_notify(self, peer: AgentMetadata, reservation: Reservation, block_ids: tuple[int, ...],
                     payload: bytes, progress: bool = False) -> TransferHandle:
        """Deliver `payload` after the request's posted writes completed (`progress`: at once, in order
        behind what was posted before it)."""

    @abstractmethod
    def _check(self, handle: TransferHandle) -> None:
        """Update handle.done / handle.error without blocking."""

    @abstractmethod
    def _wait_once(self, handle: TransferHandle, max_s: float) -> None:
        """Block up to max_s or until the handle may have changed."""

    def _abandon(self, handle: TransferHandle) -> None:
        """The handle timed out: stop tracking it (best effort)."""

    def _progress(self) -> None:
        """Drive the backend (receive notifications). Default: nothing (I/O thread does it)."""

    def _wait_notification_once(self, max_s: float) -> None:
        self._require_table().wait_changed(max_s)

    # -- helpers ---------------------------------------------------------------------------
    def _new_handle(self, reservation: Reservation, peer: str, kind: str, layer: int, num_bytes: int,
                    state: object = None) -> TransferHandle:
        now = time.monotonic()
        return TransferHandle(reservation.request_id, peer, kind, layer, num_bytes, now, now + self.timeout_s,
                              state)

    def _peer_for(self, reservation: Reservation) -> AgentMetadata:
        peer = self._peers.get(reservation.agent_name)
        if peer is None:
            raise StalePeerError(f"request {reservation.request_id}: no handshake with {reservation.agent_name}; "
                                 "call add_peer with its metadata first")
        if peer.incarnation != reservation.incarnation:
            raise StalePeerError(f"request {reservation.request_id}: the reservation was issued by incarnation "
                                 f"{reservation.incarnation[:12]} of {peer.name}, which now runs "
                                 f"{peer.incarnation[:12]}; ask the restarted peer for a new reservation")
        return peer

    def _check_deadline(self, reservation: Reservation) -> None:
        if time.time() > reservation.deadline_unix - self.clock_margin_s:
            raise ReservationExpiredError(f"request {reservation.request_id}: the reservation on "
                                          f"{reservation.agent_name} has expired; nothing was sent")

    def _check_write(self, peer: AgentMetadata, reservation: Reservation, layer: int, src: np.ndarray,
                     dst: np.ndarray) -> HeadSlice:
        rid = reservation.request_id
        if not 0 <= layer < self.layout.num_layers:
            raise BlockOutOfRangeError(f"request {rid}: layer {layer} is outside 0..{self.layout.num_layers - 1}")
        if len(src) != len(dst) or not len(src):
            raise ValueError(f"request {rid}: {len(src)} source blocks for {len(dst)} destination blocks")
        if src.min() < 0 or src.max() >= self.num_blocks:
            bad = src[(src < 0) | (src >= self.num_blocks)]
            raise BlockOutOfRangeError(f"request {rid}: source blocks {bad[:8].tolist()} are outside the local "
                                       f"pool of {self.num_blocks} blocks")
        if dst.min() < 0 or dst.max() >= peer.num_blocks:
            bad = dst[(dst < 0) | (dst >= peer.num_blocks)]
            raise BlockOutOfRangeError(f"request {rid}: destination blocks {bad[:8].tolist()} are outside "
                                       f"{peer.name}'s pool of {peer.num_blocks} blocks")
        granted = self._grant_mask(reservation, peer.num_blocks)[dst]
        if not granted.all():
            missing = np.unique(dst[~granted])
            raise NotReservedError(f"request {rid}: destination blocks {missing[:8].tolist()} are not "
                                   f"reserved for it on {peer.name}")
        self._check_deadline(reservation)
        hs = self._head_slices.get(peer.incarnation, False)
        if hs is False:
            hs = self._head_slices[peer.incarnation] = head_slice(self.layout, peer.layout)
        if hs is None:
            raise TransferError(f"request {rid}: {peer.name} holds KV heads [{peer.layout.head_start}, "
                                f"{peer.layout.head_end}), none of this rank's")
        return hs

    def _grant_mask(self, reservation: Reservation, num_blocks: int) -> np.ndarray:
        """Bool mask over the receiver's `num_blocks` of the blocks `reservation` grants (cached per object).

        Keyed by object identity with the reservation held alive, so an id is never reused
        while cached; a reservation is immutable, so its mask never goes stale.
        """
        key = id(reservation)
        with self._lock:
            cached = self._grant_masks.get(key)
            if cached is not None and cached[0] is reservation and cached[1].size == num_blocks:
                self._grant_masks.move_to_end(key)
                return cached[1]
        granted = block_ids_array(reservation.block_ids)
        mask = np.zeros(num_blocks, dtype=bool)
        mask[granted[(granted >= 0) & (granted < num_blocks)]] = True
        with self._lock:
            self._grant_masks[key] = (reservation, mask)
            while len(self._grant_masks) > _GRANT_CACHE_SIZE:
                self._grant_masks.popitem(last=False)
        return mask

    def _count(self, handle: TransferHandle) -> None:
        handle.counted = True
        handle.done_at = time.monotonic()
        if handle.error is not None:
            self._count_failure(type(handle.error))
            return
        self.metric("transfers", "send", handle.kind).inc()
        if handle.kind != "progress":           # KV and the completion's payload; a note is not KV
            self.metric("bytes", "send").inc(handle.num_bytes)
        if handle.kind == "write":
            self.metric("latency").observe(time.monotonic() - handle.posted_at)

    def _count_failure(self, error_type: type[TransferError]) -> None:
        self.metric("failures", error_type.reason).inc()

    def metric(self, name: str, *labels: str):
        """The transfer metric's child (metrics.py) for (this backend, *labels), looked up once."""
        key = (name, labels)
        child = self._metric_children.get(key)
        if child is None:
            child = self._metric_children[key] = getattr(self.metrics, name).labels(self.backend, *labels)
        return child

    def _require_pool(self) -> torch.Tensor:
        if self.pool is None:
            raise ValueError("register a KV pool first")
        return self.pool

    def _require_table(self) -> ReservationTable:
        if self._table is None:
            raise ValueError("register a KV pool first")
        return self._table
