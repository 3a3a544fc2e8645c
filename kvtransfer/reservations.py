"""The receiver's reservation table: which blocks may be written, for whom, until when.

A reservation is (request id, block ids, deadline). Writes and the completion
notification are checked against it; progress notes (frames.PROGRESS_MAGIC) are checked alike
and kept for the owner (`take_progress`) without ending it. Past its deadline a reservation is
released (its blocks may be handed out again by the engine) and remains only as
a tombstone carrying `ReservationExpiredError` until its owner asks. A write in
progress (TCP only: inflight > 0) holds off expiry until its bytes have landed;
the expiry then fails the request, so no late bytes are ever accepted as valid.

Thread-safe: a TCP receiver updates it from its I/O thread while the owner waits
on it from another.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.kvtransfer.frames import PROGRESS_MAGIC
from splitserve.kvtransfer.errors import (BlockOutOfRangeError, NotReservedError, ReservationExpiredError, StalePeerError,
                     TransferError, TransferTimeoutError)


@dataclass(slots=True)
class _Entry:
    request_id: str
    block_ids: frozenset[int]
    deadline: float                      # on the table's clock (time.monotonic())
    num_senders: int = 1                 # notifications needed (one per sending TP rank)
    num_notified: int = 0
    first_payload: bytes = b""           # first non-empty notification payload
    inflight: int = 0
    payload: bytes | None = None         # set when the notification was accepted
    error: TransferError | None = None   # set when the request failed (tombstone)
    sources: set[object] = field(default_factory=set)   # connections that wrote into it
    progress: list[bytes] = field(default_factory=list)  # progress notes not yet taken (magic stripped)


class ReservationTable:
    def __init__(self, num_blocks: int, incarnation: str, clock: Callable[[], float] = time.monotonic):
        self.num_blocks = num_blocks
        self.incarnation = incarnation
        self.clock = clock               # injected so that tests step past a deadline instead of waiting
        self._entries: dict[str, _Entry] = {}
        self._cond = threading.Condition()

    # -- owner side ----------------------------------------------------------------------
    def reserve(self, request_id: str, block_ids: list[int], ttl_s: float, num_senders: int = 1) -> float:
        """Add a reservation; returns its monotonic deadline. ValueError on misuse."""
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise BlockOutOfRangeError(f"cannot reserve blocks {bad[:8]}: pool has {self.num_blocks} blocks")
        if not block_ids or ttl_s <= 0 or num_senders < 1:
            raise ValueError("a reservation needs at least one block, a positive ttl and a sender")
        with self._cond:
            self._sweep()
            if request_id in self._entries:
                raise ValueError(f"request {request_id} already holds a reservation")
            wanted = frozenset(block_ids)
            for other in self._entries.values():
                if other.error is None and other.payload is None and wanted & other.block_ids:
                    raise ValueError(f"blocks {sorted(wanted & other.block_ids)[:8]} are already "
                                     f"reserved for request {other.request_id}")
            deadline = self.clock() + ttl_s
            self._entries[request_id] = _Entry(request_id, wanted, deadline, num_senders)
            return deadline

    def release(self, request_id: str) -> bool:
        """Forget the request's reservation (any state). False when there was none."""
        with self._cond:
            return self._entries.pop(request_id, None) is not None

    def active(self) -> dict[str, tuple[int, ...]]:
        """Open reservations (not yet notified, failed or expired): request id → sorted block ids."""
        with self._cond:
            self._sweep()
            return {rid: tuple(sorted(e.block_ids)) for rid, e in self._entries.items()
                    if e.error is None and e.payload is None}

    def take_result(self, request_id: str) -> bytes | None:
        """Payload once notified (entry removed); None while open; raises the failure (entry removed)."""
        with self._cond:
            self._sweep()
            entry = self._entries.get(request_id)
            if entry is None:
                raise NotReservedError(f"request {request_id} has no reservation on this receiver")
            if entry.error is not None or entry.payload is not None:
                del self._entries[request_id]
                if entry.error is not None:
                    raise entry.error
                return entry.payload
            return None

    def take_progress(self, request_id: str) -> list[bytes]:
        """The progress notes that arrived since the last call (oldest first); [] once ended or unknown."""
        with self._cond:
            entry = self._entries.get(request_id)
            if entry is None or not entry.progress:
                return []
            notes, entry.progress = entry.progress, []
            return notes

    def wait_changed(self, timeout_s: float) -> None:
        """Block until a notification, a failure or `timeout_s` (whichever is first)."""
        with self._cond:
            self._cond.wait(timeout_s)

    def time_out(self, request_id: str, waited_s: float) -> TransferTimeoutError:
        """Give up on a request: release its blocks and return the error to raise."""
        self.release(request_id)
        return TransferTimeoutError(f"request {request_id}: no completion notification after {waited_s:.1f} s; "
                                    "its reservation was released")

    # -- transfer side -------------------------------------------------------------------
    def begin_write(self, request_id: str, incarnation: str, block_ids: tuple[int, ...], source: object) -> None:
        """Admit a write (inflight += 1) or raise the refusal; end_write must follow."""
        with self._cond:
            entry = self._check(request_id, incarnation, block_ids)
            entry.inflight += 1
            entry.sources.add(source)

    def end_write(self, request_id: str) -> None:
        with self._cond:
            entry = self._entries.get(request_id)
            if entry is not None:
                entry.inflight -= 1
                self._sweep()

    def complete(self, request_id: str, incarnation: str, block_ids: tuple[int, ...], payload: bytes) -> bool:
        """Accept the completion notification, or raise (and fail the request) if it is invalid.
        True when it was a progress note instead (kept for `take_progress`; nothing ends)."""
        with self._cond:
            if payload[:len(PROGRESS_MAGIC)] == PROGRESS_MAGIC:
                entry = self._check(request_id, incarnation, block_ids)     # refused: the note is dropped
                entry.progress.append(payload[len(PROGRESS_MAGIC):])
                self._cond.notify_all()
                return True
            try:
                entry = self._check(request_id, incarnation, block_ids)
            except TransferError as error:
                entry = self._entries.get(request_id)
                if entry is not None and entry.error is None and entry.payload is None:
                    entry.error = error
                self._cond.notify_all()
                raise
            entry.num_notified += 1
            entry.first_payload = entry.first_payload or payload
            if entry.num_notified >= entry.num_senders:
                entry.payload = entry.first_payload
                self._cond.notify_all()
            return False

    def refuse(self, request_id: str, incarnation: str, error: TransferError) -> None:
        """Fail the open request (what was written for it is not used) and raise `error`."""
        with self._cond:
            entry = self._entries.get(request_id)
            if entry is not None and incarnation == self.incarnation and entry.error is None and entry.payload is None:
                entry.error = error
                self._cond.notify_all()
        raise error

    def fail_from_source(self, source: object, error_for: callable) -> list[str]:
        """A sending connection died: fail the open requests it wrote into."""
        failed = []
        with self._cond:
            for entry in self._entries.values():
                if source in entry.sources and entry.error is None and entry.payload is None:
                    entry.error = error_for(entry.request_id)
                    failed.append(entry.request_id)
            if failed:
                self._cond.notify_all()
        return failed

    # -- internals (lock held) -----------------------------------------------------------
    def _check(self, request_id: str, incarnation: str, block_ids: tuple[int, ...]) -> _Entry:
        if incarnation != self.incarnation:
            raise StalePeerError(f"request {request_id}: written for receiver incarnation {incarnation[:12]}, "
                                 f"this is {self.incarnation[:12]}; the sender must re-handshake")
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise BlockOutOfRangeError(f"request {request_id}: destination blocks {bad[:8]} are outside the "
                                       f"receiver's pool of {self.num_blocks} blocks")
        self._sweep()
        entry = self._entries.get(request_id)
        if entry is None:
            raise NotReservedError(f"request {request_id} holds no reservation on the receiver")
        if entry.error is not None:
            raise entry.error
        if entry.payload is not None:
            raise NotReservedError(f"request {request_id} was already completed")
        missing = sorted(set(block_ids) - entry.block_ids)
        if missing:
            raise NotReservedError(f"request {request_id}: blocks {missing[:8]} are not reserved for it")
        return entry

    def _sweep(self) -> None:
        now = self.clock()
        expired = False
        for entry in self._entries.values():
            if entry.error is None and entry.payload is None and entry.inflight == 0 and now > entry.deadline:
                entry.error = ReservationExpiredError(
                    f"request {entry.request_id}: reservation expired; its blocks were released")
                expired = True
        if expired:
            self._cond.notify_all()
