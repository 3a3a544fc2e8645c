"""One tensor-parallel rank's share of the KV transfer: its connector, writes and notifications.

Every rank of a prefill or decode worker runs one `RankTransfer` over its own
kvtransfer connector, registered on its own KV pool (its share of the KV heads,
`KVLayout.head_start/head_end`). Rank 0 runs it in the worker process, the other
ranks in their own processes, driven over the engine's control pipe
(services/engine/parallel/rank_connector_jobs.py). A
TP=1 worker is rank 0 alone, on the same code path.

Sender (prefill). `begin` handshakes with the decode worker's ranks (`add_peer`: a
no-op for a known incarnation, a replacement for a restarted peer) and keeps one
grant per decode rank whose heads overlap this rank's. `on_layer_ready` runs after
each layer of each chunk (on rank 0 the engine thread, elsewhere the rank's forward
loop) and posts, per overlapping decode rank, one WRITE of the blocks that became
complete — each prompt block once per layer (a block split across chunks is sent
with the chunk that completes it, so two writes never race on one block), never
the blocks the decode worker already holds; the connector slices the heads when the
two ranks' ranges differ. A send is *closed* by `close_send` on rank 0 (the first
token is known) and by its last layer on the other ranks. Once closed and its
writes are done, a child rank reports to rank 0 (`on_done`); rank 0 waits for its
own writes and every child's report (`rank_reported`), then notifies every decode
rank with the first token. One notifier per request means the decode side reserves
with one sender per rank whatever the prefill worker's TP degree (it need not know
it), and each notification still arrives after every byte into that rank landed: a
write is DONE only once remotely complete, on both backends.

Fence (prefill). `fence` answers a decode worker that gave a request up: the send
is dropped, a later `begin` for the request is refused (the fence may overtake its
Prefill call), and the callback runs once none of the writes already posted is in
flight (write_fences.py says why the decode worker waits for that). Posting and
fencing take the driver's lock, so no write is posted after a fence returned.

Receiver (decode). `expect` reserves blocks on this rank's connector; `watch`
registers a callback for the notification's payload or the failure.

A `_Driver` thread per rank polls write handles, notification handles and expected
notifications every half millisecond while anything is pending (NIXL runs without a
progress thread, so someone must poll; for TCP the polling only reads futures) and
sleeps on an event when idle. No engine step ever blocks on the network.
"""

from __future__ import annotations

import asyncio

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from splitserve.kvtransfer import AgentMetadata, Connector, Reservation, TransferHandle
from splitserve.kvtransfer.connector import DIGEST_STREAM, PROGRESS_NOTES
from splitserve.kvtransfer.errors import ReservationExpiredError, TransferError, TransferTimeoutError
from splitserve.kvtransfer import transfer_digest
from splitserve.kvtransfer.faults import FaultSwitch
from splitserve.kvtransfer.layout import KVLayout
from splitserve.kvtransfer.tp_slicing import head_slice
from splitserve.kvtransfer.sender_receiver import LayerReady

from splitserve.kvtransfer.sender_receiver import TransferEndpoint, TransferGrant, TransferTarget

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 5e-4
FENCE_MEMORY_S = 600.0        # longer than any grant: a Prefill arriving after its fence is refused

Done = Callable[[bytes | None, TransferError | None], None]   # (payload, None) or (None, error)


@dataclass(slots=True)
class _Send:
    """One request being pushed from this rank to a decode worker."""

    write_grants: list[Reservation]      # decode ranks whose heads overlap this rank's
    notify_grants: list[Reservation]     # rank 0: every decode rank; other ranks: none
    dst_block_ids: list[int]             # destination of each prompt block
    num_prompt_tokens: int
    next_block: list[int]                # per layer: first prompt block not yet posted
    deadline_unix: float                 # the grant's; an open send past it fails
    pending_ranks: set[int] = field(default_factory=set)   # rank 0: children not yet reported
    writes: list[TransferHandle] = field(default_factory=list)
    error: TransferError | None = None
    payload: bytes = b""
    notifies: list[TransferHandle] | None = None
    on_done: Done | None = None          # told once the send ended (driver thread)
    closed: bool = False                 # nothing more will be posted: the driver finishes it
    digest: transfer_digest.StreamDigest | None = None   # where the receiver verifies this send
    announce: bool = False               # tell the receiver each layer that landed (transfer_digest.py)
    announced: int = 0                   # layers announced so far, in order
    notes: list[TransferHandle] = field(default_factory=list)   # the announcements posted
    to_digest: list[tuple[int, list[int], list[int]]] = field(default_factory=list)  # (layer, src, dst) posted
    fault: str = ""                      # faults.py's transfer fault, injected into the middle layer
    first_posted_at: float = 0.0         # time.monotonic() of the first layer report, and of the last
    all_posted_at: float = 0.0

    def all_posted(self) -> bool:
        return all(n == len(self.dst_block_ids) for n in self.next_block)


@dataclass(slots=True)
class _LayerChecks:
    """Receiver: the layers of one request checked as their progress notes came (transfer_digest.py)."""

    held: dict[int, int] = field(default_factory=dict)     # layer → its digest, which matched
    mismatched: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Drain:
    """A fenced send: `done` once none of its posted writes is in flight."""

    request_id: str
    handles: list[TransferHandle]
    done: Done


class _Driver(threading.Thread):
    """Polls the connector while transfers are pending; tells each one's `Done` callback."""

    def __init__(self, connector: Connector):
        super().__init__(name=f"kv-transfer-{connector.name}", daemon=True)
        self.connector = connector
        self.lock = threading.Lock()
        self.sends: dict[str, _Send] = {}
        self.expected: dict[str, Done | None] = {}
        self.draining: list[_Drain] = []         # fenced sends whose posted writes may be in flight
        self.on_progress: Callable[[str, list[bytes]], None] | None = None   # receiver: progress notes
        self._wake = threading.Event()
        self._stopping = False

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self.is_alive():
            self.join(5)

    def run(self) -> None:
        while not self._stopping:
            with self.lock:
                busy = bool(self.expected) or bool(self.sends) or bool(self.draining)
            if not busy:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                self._poll_once()
            except Exception:          # never let the driver die: requests would hang to their deadline
                log.exception("KV transfer driver: poll failed")
            self._wake.wait(POLL_INTERVAL_S)
            self._wake.clear()

    def _poll_once(self) -> None:
        self.connector.progress()
        now = time.time()
        with self.lock:
            for rid, send in self.sends.items():
                if not send.closed and now > send.deadline_unix and send.error is None:
                    send.error = ReservationExpiredError(f"request {rid}: the grant expired before "
                                                         "the prefill finished")
                    send.closed = send.on_done is not None
            sends = [(rid, s) for rid, s in self.sends.items() if s.closed]
            open_sends = [s for s in self.sends.values() if not s.closed]
            expected = [(rid, w) for rid, w in self.expected.items() if w is not None]
            expecting = list(self.expected) if self.on_progress is not None else []
            draining = list(self.draining)
        for rid in expecting:                    # before the completions: their checks queue first
            notes = self.connector.take_progress(rid)
            if notes:
                self.on_progress(rid, notes)
        for drain in draining:
            self._drive_drain(drain)
        for send in open_sends:
            self._poll_writes(send)              # each write's completion time, while the prompt computes
            if send.announce:
                self._announce(send)
            else:
                self._digest(send)
        for rid, send in sends:
            self._drive_send(rid, send)
        for rid, done in expected:
            try:
                payload = self.connector.poll_notification(rid)
            except TransferError as error:
                self._resolve_expected(rid, done, None, error)
                continue
            if payload is not None:
                self._resolve_expected(rid, done, payload, None)

    def _digest(self, send: _Send, layer: int | None = None) -> None:
        """Hash the source blocks of the writes posted so far (they do not change until the send
        ends), or only those of `layer`."""
        with self.lock:
            if layer is None:
                items, send.to_digest = send.to_digest, []
            else:
                items = [item for item in send.to_digest if item[0] == layer]
                send.to_digest = [item for item in send.to_digest if item[0] != layer]
        for item_layer, src, dst in items:
            send.digest.add_write(self.connector.pool, item_layer, src, dst)

    def _announce(self, send: _Send) -> None:
        """Post a progress note for each layer, in order, once every write of it is done: its
        digest, so the receiver checks it while later layers fly (transfer_digest.py). A layer is
        hashed only then, between polls, while its bytes are still in cache from being sent."""
        with self.lock:                          # what is posted now: a complete layer gets no more
            posted = list(send.next_block)
            writes = list(send.writes)
        total = len(send.dst_block_ids)
        while send.announced < len(posted) and posted[send.announced] == total:
            layer = send.announced
            if any(not h.done for h in writes if h.layer == layer):
                return
            self._digest(send, layer)
            note = transfer_digest.layer_note(layer, send.digest.layer_result(layer))
            try:
                send.notes.extend(self.connector.post_progress(grant, note) for grant in send.notify_grants)
            except (TransferError, ValueError):
                send.announce = False            # the completion's envelope still covers every layer
                return
            send.announced += 1

    def _poll_writes(self, send: _Send) -> None:
        for handle in send.notes:
            if not handle.finished:
                try:
                    self.connector.poll(handle)
                except TransferError:
                    pass                        # a lost note: the receiver checks that layer at the end
        for handle in list(send.writes):
            if not handle.counted:              # a write may be done when posted: counted at its first poll
                try:
                    self.connector.poll(handle)
                except TransferError:
                    pass                        # the send fails when it is driven to its end

    def _drive_send(self, rid: str, send: _Send) -> None:
        c = self.connector
        try:
            if send.error is not None:
                raise send.error
            if send.digest is not None and send.notifies is None:
                self._poll_writes(send)         # while the last writes are in flight
                if send.announce:
                    self._announce(send)
                else:
                    self._digest(send)
            for handle in send.writes:
                if not handle.done or not handle.counted:
                    c.poll(handle)              # raises the write's error; counts (and times) a done one
            if not all(h.done for h in send.writes) or send.pending_ranks:
                return                          # writes in flight here or on another rank
            if send.notifies is None:
                payload = send.payload
                if send.digest is not None:
                    self._digest(send)
                    payload = transfer_digest.seal(payload, *send.digest.result(), send.digest.algorithm)
                send.notifies = [c.notify(grant, payload) for grant in send.notify_grants]
            for handle in send.notifies:
                if not handle.done or not handle.counted:
                    c.poll(handle)
            if not all(h.done for h in send.notifies):
                return
        except TransferError as error:
            self._resolve_send(rid, send, error)
            return
        except ValueError as error:             # e.g. a payload over the notification limit
            self._resolve_send(rid, send, TransferError(f"request {rid}: {error}"))
            return
        self._resolve_send(rid, send, None)

    def _drive_drain(self, drain: "_Drain") -> None:
        for handle in drain.handles:
            if not handle.finished:
                try:
                    self.connector.poll(handle)
                except TransferError:
                    pass                        # ended: not in flight any more (a timeout says so below)
        if not all(h.finished for h in drain.handles):
            return
        with self.lock:
            self.draining.remove(drain)
        self.connector.forget_request(drain.request_id)
        timed_out = [h for h in drain.handles if isinstance(h.error, TransferTimeoutError)]
        drain.done(None, TransferTimeoutError(f"request {drain.request_id}: {len(timed_out)} write(s) did not "
                                              "complete; whether they still land is unknown") if timed_out else None)

    def _resolve_send(self, rid: str, send: _Send, error: TransferError | None) -> None:
        with self.lock:
            if self.sends.get(rid) is not send:
                return
            del self.sends[rid]
        if error is not None or not send.notify_grants:
            self.connector.forget_request(rid)   # nothing will notify: drop the written-block records
        if error is None and send.notifies:
            self._observe_timing(send)
        if send.on_done is not None:
            send.on_done(None, error)

    def _observe_timing(self, send: _Send) -> None:
        """The send's layer-wise overlap, from this rank's own timestamps (transfer metrics)."""
        first_layer = [h.done_at for h in send.writes if h.layer == 0 and h.done_at]
        notified = max((h.done_at for h in send.notifies), default=0.0)
        if not (first_layer and notified and send.all_posted_at):
            return
        c = self.connector
        c.metric("layer_lead").observe(max(send.all_posted_at - min(first_layer), 0.0))
        c.metric("exposed").observe(max(notified - send.all_posted_at, 0.0))
        if c.layout.num_layers > 1:
            c.metric("layer_compute").observe((send.all_posted_at - send.first_posted_at) / (c.layout.num_layers - 1))

    def _resolve_expected(self, rid: str, done: Done, payload: bytes | None, error: TransferError | None) -> None:
        with self.lock:
            if self.expected.get(rid) is not done:
                return
            del self.expected[rid]
        done(payload, error)


def _parse(request_id: str, ep: TransferEndpoint) -> AgentMetadata:
    try:
        return AgentMetadata.from_bytes(ep.agent_metadata)
    except (ValueError, KeyError, TypeError) as error:
        raise TransferError(f"request {request_id}: unreadable agent metadata from {ep.agent_name}: {error}") from None


class RankTransfer:
    """One rank's connector with its driver; every method but the callbacks returns at once."""

    def __init__(self, connector: Connector, block_size: int):
        self.connector = connector
        self.backend = connector.backend
        self.block_size = block_size
        self.metadata: AgentMetadata = connector.metadata()
        self._driver = _Driver(connector)
        self._driver.start()
        self._fenced: dict[str, float] = {}     # request id -> until when a late Prefill for it is refused
        self._faults = FaultSwitch.from_env()      # off unless SPLITSERVE_KV_FAULTS / _FAULT_FILE say
        self._granted: dict[str, list[int]] = {}          # receiver: each expected request's blocks
        self._verifier: ThreadPoolExecutor | None = None  # receiver: digests off the driver thread
        self._checked: dict[str, _LayerChecks] = {}       # receiver: layers checked before the completion
        self._driver.on_progress = self._on_progress
        self._close_lock = threading.Lock()
        self._closed = False

    # -- sender (prefill) ---------------------------------------------------------------
    def begin(self, request_id: str, target: TransferTarget, num_prompt_tokens: int, *, notify: bool,
              pending_ranks: set[int] | None = None, on_done: Done | None = None) -> None:
        """Prepare to push `request_id` into `target`'s decode ranks. `notify`: this rank sends
        the completion notifications (rank 0), after `pending_ranks` reported. `on_done`
        given: the send closes itself after its last layer (a child rank)."""
        grant = target.grant
        if grant is None or not target.endpoint.agent_name:
            raise TransferError(f"request {request_id}: the Prefill call carries no transfer grant")
        num_blocks = -(-num_prompt_tokens // self.block_size)
        if len(target.block_ids) != num_blocks or not 0 <= target.num_cached_blocks < num_blocks:
            raise TransferError(f"request {request_id}: {len(target.block_ids)} destination blocks "
                                f"({target.num_cached_blocks} cached) for a {num_prompt_tokens}-token prompt")
        skipped = target.num_cached_blocks
        granted = tuple(target.block_ids[skipped:])
        write_grants, notify_grants = [], []
        for ep in (target.endpoint, *target.endpoint.other_ranks):
            incarnation = ep.incarnation or grant.incarnation
            known = self.connector.peer(ep.agent_name)
            meta = known if known is not None and known.incarnation == incarnation else _parse(request_id, ep)
            writes = head_slice(self.connector.layout, meta.layout) is not None
            if not (writes or notify):
                continue                     # a decode rank that holds none of this rank's heads
            if meta is not known:
                self.connector.add_peer(meta)        # LayoutMismatchError names the differing fields
                log.info("KV transfer %s: handshake with %s (incarnation %s)", self.connector.name, meta.name,
                         meta.incarnation[:12])
            reservation = Reservation(request_id, ep.agent_name, incarnation, granted, grant.deadline_unix)
            if writes:
                write_grants.append(reservation)
            if notify:
                notify_grants.append(reservation)
        send = _Send(write_grants, notify_grants, list(target.block_ids), num_prompt_tokens,
                     [skipped] * self.connector.layout.num_layers, grant.deadline_unix,
                     set(pending_ranks or ()), on_done=on_done)
        if notify and on_done is None and self._verifiable(target):
            peer = self.connector.peer(target.endpoint.agent_name)
            send.digest = self._digest_for(peer)
            send.announce = (isinstance(send.digest, transfer_digest.StreamDigest)
                             and PROGRESS_NOTES in peer.features)
            send.fault = self._injected_fault(request_id)
        with self._driver.lock:
            if self._fenced.get(request_id, 0.0) > time.monotonic():
                raise TransferError(f"request {request_id}: its receiver fenced it (cancelled); "
                                    "nothing is sent for it")
            if request_id in self._driver.sends:
                raise TransferError(f"request {request_id} is already being sent")
            self._driver.sends[request_id] = send
        self._driver.wake()

    # The digest a verified send carries (a benchmark swaps in an earlier one to compare).
    new_digest: Callable[[KVLayout], transfer_digest.StreamDigest] = transfer_digest.StreamDigest

    def _verifiable(self, target: TransferTarget) -> bool:
        """Whether the receiver can check this send's digest: one rank each side, CPU pools."""
        if target.endpoint.other_ranks or self.connector.layout.tp_size != 1:
            return False
        peer = self.connector.peer(target.endpoint.agent_name)
        pool = self.connector.pool
        return (peer is not None and peer.layout.tp_size == 1 and peer.device == "cpu"
                and pool is not None and pool.device.type == "cpu")

    def _digest_for(self, peer: AgentMetadata) -> transfer_digest.StreamDigest | transfer_digest.BlockSumDigest:
        if DIGEST_STREAM in peer.features:
            return self.new_digest(self.connector.layout)
        # A receiver from before the KVd3 envelope (a rolling update): every one checks KVd1.
        return transfer_digest.BlockSumDigest(self.connector.layout, transfer_digest.CRC32)

    def _injected_fault(self, request_id: str) -> str:
        """A fault for this send (faults.py), only where the receiver verifies it: caught, never decoded."""
        return self._faults.hit("transfer", f"the send of request {request_id}")

    def on_layer_ready(self, ready: LayerReady) -> None:
        """Post this rank's writes of the blocks `ready` completed; never raises."""
        with self._driver.lock:              # a fence either sees these writes or stops them
            send = self._driver.sends.get(ready.request_id)
            if send is None or send.closed:
                return
            if send.error is None:
                self._post_layer(send, ready)
            close = send.on_done is not None and (send.error is not None or send.all_posted())
            if close:
                send.closed = True               # a child rank's last layer: finish on the driver
        if close:
            self._driver.wake()

    def _post_layer(self, send: _Send, ready: LayerReady) -> None:
        final = ready.num_tokens >= send.num_prompt_tokens
        end = -(-ready.num_tokens // self.block_size) if final else ready.num_tokens // self.block_size
        start = send.next_block[ready.layer]
        if end <= start:
            return
        offset = start - ready.first_block
        src = ready.block_ids[offset:offset + end - start]
        dst = send.dst_block_ids[start:end]
        try:
            if offset < 0 or len(src) != end - start:
                raise TransferError(f"request {ready.request_id}: layer {ready.layer} reported blocks "
                                    f"{ready.first_block}.. but blocks {start}..{end} are due")
            posted = self._faulty(send, ready.layer, src)
            if posted:
                for grant in send.write_grants:
                    send.writes.append(self.connector.write_layer(grant, ready.layer, posted, dst))
        except TransferError as error:
            send.error = error
            return
        except ValueError as error:
            send.error = TransferError(f"request {ready.request_id}: {error}")
            return
        send.next_block[ready.layer] = end
        if send.digest is not None:
            send.to_digest.append((ready.layer, list(src), list(dst)))
        now = time.monotonic()
        send.first_posted_at = send.first_posted_at or now
        if send.all_posted():
            send.all_posted_at = now

    def _faulty(self, send: _Send, layer: int, src: list[int]) -> list[int]:
        """The source blocks to post: `src`, or the injected fault's (none, or others) for the middle layer."""
        if not send.fault or layer != self.connector.layout.num_layers // 2:
            return src
        if send.fault == "drop":
            return []
        return [(b + 1) % self.connector.num_blocks for b in src]

    def close_send(self, request_id: str, payload: bytes, on_done: Done) -> None:
        """Rank 0: the prefill is done. Notify once every rank's writes are done; then `on_done`."""
        with self._driver.lock:
            send = self._driver.sends.get(request_id)
            if send is None:
                raise TransferError(f"request {request_id}: nothing is being sent for it")
            if send.error is None and not send.all_posted():
                send.error = TransferError(f"request {request_id}: the prefill ended before every "
                                           "layer of every block was posted")
            send.payload, send.on_done, send.closed = payload, on_done, True
        self._driver.wake()

    def rank_reported(self, request_id: str, rank: int, error: TransferError | None) -> None:
        """Rank 0: child `rank` finished its writes for `request_id` (or failed)."""
        with self._driver.lock:
            send = self._driver.sends.get(request_id)
            if send is None:
                return
            send.pending_ranks.discard(rank)
            if error is not None and send.error is None:
                send.error = error
        self._driver.wake()

    def abandon(self, request_id: str) -> None:
        with self._driver.lock:
            self._driver.sends.pop(request_id, None)
        self.connector.forget_request(request_id)

    def fence(self, request_id: str, done: Done) -> None:
        """The receiver gave `request_id`'s blocks up: post nothing more for it (a Prefill that
        arrives later is refused too) and call `done` (driver thread) once none of its posted
        writes is in flight; with an error when some timed out (they may still land)."""
        now = time.monotonic()
        with self._driver.lock:
            self._fenced = {rid: until for rid, until in self._fenced.items() if until > now}
            self._fenced[request_id] = now + FENCE_MEMORY_S
            send = self._driver.sends.pop(request_id, None)
            handles = [] if send is None else [h for h in (*send.writes, *send.notes, *(send.notifies or ()))
                                               if not h.finished]
            if handles:
                self._driver.draining.append(_Drain(request_id, handles, done))
        if handles:
            self._driver.wake()
            return
        self.connector.forget_request(request_id)
        done(None, None)

    # -- receiver (decode) ----------------------------------------------------------------
    def expect(self, request_id: str, block_ids: list[int], ttl_s: float) -> Reservation:
        try:
            grant = self.connector.reserve(request_id, block_ids, ttl_s)
        except ValueError as error:
            raise TransferError(f"request {request_id}: cannot reserve its blocks for a transfer: {error}") from None
        with self._driver.lock:
            self._driver.expected[request_id] = None
            self._granted[request_id] = list(block_ids)
        self._driver.wake()
        return grant

    def watch(self, request_id: str, done: Done) -> None:
        """Call `done` (driver thread, or the digest thread) with the notification's payload, once the
        blocks match the sender's digest where it sent one, or with the failure."""
        with self._driver.lock:
            if request_id not in self._driver.expected:
                raise TransferError(f"request {request_id}: no transfer is expected for it")
            self._driver.expected[request_id] = lambda payload, error: self._verify(request_id, payload, error, done)
        self._driver.wake()

    def _verify(self, request_id: str, payload: bytes | None, error: TransferError | None, done: Done) -> None:
        sent, inner = transfer_digest.unseal(payload) if payload is not None else (None, payload)
        if error is not None or sent is None:
            done(payload, error)
            return
        with self._driver.lock:
            blocks = self._granted.get(request_id, [])
        self._verifier_pool().submit(self._compare, request_id, sent, inner, blocks, done)

    def _verifier_pool(self) -> ThreadPoolExecutor:
        """One thread, so a request's layer checks run before its completion's (FIFO)."""
        with self._driver.lock:
            if self._verifier is None:
                self._verifier = ThreadPoolExecutor(1, thread_name_prefix=f"kv-digest-{self.connector.name}")
            return self._verifier

    def _on_progress(self, request_id: str, notes: list[bytes]) -> None:
        """Driver thread: a sender announced layers that landed; check each off the driver."""
        for note in notes:
            announced = transfer_digest.read_layer_note(note)
            if announced is not None:
                self._verifier_pool().submit(self._check_layer, request_id, *announced)

    def _check_layer(self, request_id: str, layer: int, digest: int) -> None:
        with self._driver.lock:
            blocks = self._granted.get(request_id)
        if blocks is None or not 0 <= layer < self.connector.layout.num_layers:
            return                               # released meanwhile, or not a layer: the end checks all
        held = transfer_digest.held_layer_digest(self.connector.pool, self.connector.layout, blocks, layer)
        with self._driver.lock:
            if request_id in self._granted:
                checks = self._checked.setdefault(request_id, _LayerChecks())
                if held == digest:
                    checks.held[layer] = held
                else:
                    checks.mismatched.append(layer)

    def _compare(self, request_id: str, sent: tuple[int, int, bytes], inner: bytes, blocks: list[int],
                 done: Done) -> None:
        c = self.connector
        total, pairs, algorithm = sent
        with self._driver.lock:
            checks = self._checked.pop(request_id, _LayerChecks())
        held = (None, 0) if checks.mismatched else transfer_digest.held_digest(
            c.pool, c.layout, blocks, algorithm, checks.held if algorithm == transfer_digest.STREAM else None)
        if held == (total, pairs):
            done(inner, None)
            return
        c.metric("digest_mismatches").inc()
        found = (f"layers {checks.mismatched} differ" if checks.mismatched else
                 f"digest {held[0]:016x} over {held[1]} blocks, sent {total:016x} over {pairs}")
        done(None, TransferError(f"request {request_id}: the KV received differs from what the prefill worker wrote "
                                 f"({found}); it is recomputed"))

    def release(self, request_id: str) -> None:
        with self._driver.lock:
            self._driver.expected.pop(request_id, None)
            self._granted.pop(request_id, None)
            self._checked.pop(request_id, None)
        self.connector.release(request_id)

    def num_open(self) -> int:
        return len(self.connector.active_reservations())

    def close(self) -> None:
        """Stop the driver and close the connector; idempotent, from any thread."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._driver.stop()
            if self._verifier is not None:
                self._verifier.shutdown(wait=True)
            self.connector.close()


def settle(waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future], result, error: BaseException | None) -> None:
    """Resolve an asyncio future from any thread (nothing happens once its loop is closed)."""
    loop, future = waiter

    def apply() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    try:
        loop.call_soon_threadsafe(apply)
    except RuntimeError:       # the event loop is closed: nobody waits any more
        pass


class SingleRankTransfer:
    """Both halves (`KVSender` and `KVReceiver`) of a process whose KV is one connector's pool: an
    engine without tensor parallelism. The asyncio face of `RankTransfer`; an engine with more
    ranks extends it with their fan-out (services/engine/rank_connectors.py)."""

    def __init__(self, connector: Connector, block_size: int, other_ranks: tuple[TransferEndpoint, ...] = ()):
        self.local = RankTransfer(connector, block_size)
        self.connector = connector
        self.backend = connector.backend
        self.block_size = block_size
        m = self.local.metadata
        self._endpoint = TransferEndpoint(m.name, m.to_bytes(), m.layout_hash.encode(), m.incarnation, other_ranks)

    # -- receiver (decode) ------------------------------------------------------------
    def endpoint(self) -> TransferEndpoint:
        return self._endpoint

    def expect(self, request_id: str, block_ids: list[int], ttl_s: float) -> TransferGrant:
        return self.local.expect(request_id, block_ids, ttl_s)

    async def wait_complete(self, request_id: str) -> bytes:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.local.watch(request_id, lambda payload, error: settle((loop, future), payload, error))
        return await future

    def release(self, request_id: str) -> None:
        self.local.release(request_id)

    def num_open(self) -> int:
        return self.local.num_open()

    # -- sender (prefill) ---------------------------------------------------------------
    def begin(self, request_id: str, target: TransferTarget, num_prompt_tokens: int) -> None:
        self.local.begin(request_id, target, num_prompt_tokens, notify=True)

    def on_layer_ready(self, ready: LayerReady) -> None:
        self.local.on_layer_ready(ready)

    async def finish(self, request_id: str, payload: bytes) -> None:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.local.close_send(request_id, payload, lambda _, error: settle((loop, future), None, error))
        await future

    def abandon(self, request_id: str) -> None:
        self.local.abandon(request_id)

    # What else a fence may fail with (the other ranks' control channel, for a TP facade).
    fence_errors: tuple[type[BaseException], ...] = ()

    async def fence(self, request_id: str, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.local.fence(request_id, lambda _, error: settle((loop, future), None, error))
        others = self.fence_others(request_id, timeout_s)
        try:
            async with asyncio.timeout(timeout_s + 1.0):
                await future
                return all(await others) if others is not None else True
        except (TimeoutError, TransferError, *self.fence_errors) as error:
            log.warning("KV transfer: request %s: cannot confirm its writes stopped: %s", request_id,
                        str(error) or "timed out")
            return False

    def fence_others(self, request_id: str, timeout_s: float) -> asyncio.Future[list[bool]] | None:
        """The other ranks' fences of a TP facade, each True once its writes stopped; None here."""
        return None

    def close(self) -> None:
        self.local.close()

