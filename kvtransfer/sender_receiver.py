"""The seam between a worker and the KV transfer of one request's prompt (issue 3).

A decode worker reserves blocks for a prompt and lets one prefill worker write
the prompt's KV into them (`KVReceiver`); the prefill worker pushes each layer
as soon as the engine reports it done (`KVSender`). The worker only calls
these two protocols, which an engine builds over its own KV memory (the built-in
engine: services/engine/rank_connectors.py, over `RankTransfer` per TP rank).

An aggregated worker (role both) is built with `UnwiredTransfer`, which
refuses every transfer with `TransferNotWiredError`: a Prefill call to it fails
with a clear message, and a Generate call that names a prefill peer is
prefilled locally.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from splitserve.kvtransfer.errors import TransferError

__all__ = ["GRANT_GRACE_S", "KVReceiver", "KVSender", "LayerCallback", "LayerReady", "TransferEndpoint",
           "TransferError", "TransferGrant", "TransferNotWiredError", "TransferTarget", "UnwiredTransfer"]


GRANT_GRACE_S = 1.0     # a sender gives a request up this long after its grant's deadline


@dataclass(slots=True, frozen=True)
class LayerReady:
    """A prefill-only request's KV for `layer` is written in `block_ids`.

    `block_ids` are the sequence's blocks from position `first_block` on; the
    first report of a request starts at block 0, so blocks that came from the
    local prefix cache are reported too (the receiver may already hold some).
    """

    request_id: str
    layer: int
    first_block: int
    block_ids: list[int]
    num_tokens: int          # prompt tokens whose KV is now complete in these blocks


LayerCallback = Callable[[LayerReady], None]


class TransferNotWiredError(TransferError):
    """This worker has no KV transfer (an aggregated worker)."""

    reason = "not_wired"


@dataclass(slots=True, frozen=True)
class TransferEndpoint:
    """How a prefill worker reaches a decode worker's KV pool.

    A decode worker with tensor parallelism has one transfer agent per rank, each
    registered on that rank's share of the KV heads: this endpoint is rank 0's, and
    `other_ranks` are ranks 1..M-1 (each grants the same block ids, under its own
    incarnation, until the same deadline)."""

    agent_name: str
    agent_metadata: bytes          # kvtransfer AgentMetadata.to_bytes()
    layout_hash: bytes
    incarnation: str = ""          # changes when the decode worker restarts
    other_ranks: tuple[TransferEndpoint, ...] = ()


@dataclass(slots=True, frozen=True)
class TransferGrant:
    """The receiver's permission for one request: which incarnation, until when.

    A sender posts no write past `deadline_unix` and gives the request up GRANT_GRACE_S
    after it, so a receiver knows when no write for the grant can land any more."""

    incarnation: str
    deadline_unix: float


@dataclass(slots=True, frozen=True)
class TransferTarget:
    """Where one request's prompt KV goes: the decode worker's reserved blocks.

    `block_ids[i]` receives prompt block i; the first `num_cached_blocks` are
    already in the decode worker's prefix cache and are not sent (the grant
    covers `block_ids[num_cached_blocks:]` only).
    """

    endpoint: TransferEndpoint
    block_ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    grant: TransferGrant | None = None


class KVReceiver(Protocol):
    """Decode side. Every method but `wait_complete` returns at once."""

    backend: str

    def endpoint(self) -> TransferEndpoint:
        """This worker's agent name, metadata and layout hash, sent along with each Prefill call."""

    def expect(self, request_id: str, block_ids: list[int], ttl_s: float) -> TransferGrant:
        """Accept writes tagged `request_id` into exactly `block_ids` for `ttl_s` seconds, until
        the notification arrives or `release`. Raises TransferError when it cannot."""

    async def wait_complete(self, request_id: str) -> bytes:
        """Return the completion notification's payload once every layer of every block is
        in place. Raises TransferError on failure (sender lost, expired); the caller bounds
        the wait with its own timeout."""

    def release(self, request_id: str) -> None:
        """Refuse further writes for `request_id`. Idempotent; called on every end
        (finished, aborted, failed), before the blocks go back to the pool."""

    def num_open(self) -> int:
        """Open reservations (a leak check: 0 when idle)."""


class KVSender(Protocol):
    """Prefill side."""

    backend: str

    def begin(self, request_id: str, target: TransferTarget, num_prompt_tokens: int) -> None:
        """Prepare to push `request_id` into `target` (handshake, check the layout hash).

        Raises TransferError when the peer cannot be used; nothing is computed then.
        """

    def on_layer_ready(self, ready: LayerReady) -> None:
        """Engine thread, after each layer of each chunk: post the WRITE of the blocks that
        are complete now. Must not block on the network (it delays the next layer) and
        never raises: a failure is reported by `finish`."""

    async def finish(self, request_id: str, payload: bytes) -> None:
        """The prefill is done and every layer was posted: wait until all writes completed,
        then notify the receiver with `payload` and wait for that. Raises TransferError."""

    def abandon(self, request_id: str) -> None:
        """The request was cancelled or failed: drop what is pending. Idempotent."""

    async def fence(self, request_id: str, timeout_s: float) -> bool:
        """The receiver gave the request's blocks up: post nothing more for it, on every
        rank, refuse a later `begin` for it, and return once none of its writes is in
        flight: True, or False when that is not known within `timeout_s` (a write timed
        out, a rank did not answer)."""

    def close(self) -> None:
        """Stop background work and release the connector."""


NOT_WIRED_MESSAGE = ("this worker has no KV transfer (it runs with --role both); run prefill and decode "
                     "workers with --role prefill / --role decode for disaggregated serving")


class UnwiredTransfer:
    """Both halves, refusing every transfer. Cleanup calls are harmless no-ops."""

    backend = ""

    def endpoint(self) -> TransferEndpoint:
        raise TransferNotWiredError(NOT_WIRED_MESSAGE)

    def expect(self, request_id: str, block_ids: list[int], ttl_s: float) -> TransferGrant:
        raise TransferNotWiredError(NOT_WIRED_MESSAGE)

    async def wait_complete(self, request_id: str) -> bytes:
        raise TransferNotWiredError(NOT_WIRED_MESSAGE)

    def release(self, request_id: str) -> None:
        pass

    def num_open(self) -> int:
        return 0

    def begin(self, request_id: str, target: TransferTarget, num_prompt_tokens: int) -> None:
        raise TransferNotWiredError(NOT_WIRED_MESSAGE)

    def on_layer_ready(self, ready: LayerReady) -> None:
        pass

    async def finish(self, request_id: str, payload: bytes) -> None:
        raise TransferNotWiredError(NOT_WIRED_MESSAGE)

    def abandon(self, request_id: str) -> None:
        pass

    async def fence(self, request_id: str, timeout_s: float) -> bool:
        return True                     # it never sends

    def close(self) -> None:
        pass
