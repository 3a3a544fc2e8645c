"""Transfer errors: all recoverable (the request fails, the worker carries on).

Every error's `str()` says what happened and, where there is one, what to do
next. Each has a short `reason` used as the metrics label. Errors carry only
a message so that they pickle across processes unchanged.
"""

from __future__ import annotations

from splitserve.errors import RecoverableError


class TransferError(RecoverableError):
    """A KV transfer was refused or failed; the request must be retried or prefilled locally."""

    reason = "error"


class LayoutMismatchError(TransferError):
    """The peers' KV layouts differ in a hashed field (named in the message)."""

    reason = "layout_mismatch"


class BlockOutOfRangeError(TransferError):
    """A block id is outside the pool it refers to."""

    reason = "block_out_of_range"


class NotReservedError(TransferError):
    """A destination block is not reserved for this request id on the receiver."""

    reason = "not_reserved"


class ReservationExpiredError(TransferError):
    """The receiver's reservation passed its deadline; its blocks were released."""

    reason = "reservation_expired"


class StalePeerError(TransferError):
    """The peer is unknown or restarted since the reservation/metadata was issued."""

    reason = "stale_peer"


class PeerLostError(TransferError):
    """The connection to the peer broke while a transfer was in flight."""

    reason = "peer_lost"


class TransferTimeoutError(TransferError):
    """A transfer or notification did not complete within the configured timeout."""

    reason = "timeout"


class PeerAuthError(TransferError):
    """The peer did not prove it holds the deployment's transfer token (kvtransfer/auth.py)."""

    reason = "unauthenticated"


ERRORS_BY_CODE: dict[int, type[TransferError]] = {
    1: TransferError, 2: LayoutMismatchError, 3: BlockOutOfRangeError, 4: NotReservedError,
    5: ReservationExpiredError, 6: StalePeerError, 7: PeerLostError, 8: TransferTimeoutError,
    9: PeerAuthError,
}
CODE_BY_ERROR = {cls: code for code, cls in ERRORS_BY_CODE.items()}
