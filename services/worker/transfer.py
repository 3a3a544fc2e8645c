"""The seam between a worker and the KV transfer (kvtransfer, issue 3).

A decode worker reserves blocks for a prompt and lets one prefill worker write
the prompt's KV into them (`KVReceiver`); the prefill worker pushes each layer
as soon as the engine reports it done (`KVSender`). The worker only calls
these two protocols; an adapter over kvtransfer's Connector implements them.

Until that adapter exists the worker is built with `UnwiredTransfer`, which
refuses every transfer with `TransferNotWiredError`: a disaggregated request
fails with a clear message instead of pretending to work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from splitserve.errors import RecoverableError
from splitserve.services.engine.sequence import LayerReady


class TransferError(RecoverableError):
    """A KV transfer was refused or failed (layout mismatch, peer gone, bad block ids)."""


class TransferNotWiredError(TransferError):
    """This build has no KV transfer behind the disaggregated roles yet."""


@dataclass(slots=True, frozen=True)
class TransferEndpoint:
    """How a prefill worker reaches a decode worker's KV pool."""

    agent_name: str
    agent_metadata: bytes
    layout_hash: bytes


@dataclass(slots=True, frozen=True)
class TransferTarget:
    """Where one request's prompt KV goes: the decode worker's reserved blocks.

    `block_ids[i]` receives prompt block i; the first `num_cached_blocks` are
    already in the decode worker's prefix cache and need not be sent.
    """

    endpoint: TransferEndpoint
    block_ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0


class KVReceiver(Protocol):
    """Decode side. Every method but `wait_complete` is called on the asyncio thread."""

    def endpoint(self) -> TransferEndpoint:
        """This worker's agent name, metadata and layout hash, sent along with each Prefill call."""

    def expect(self, request_id: str, block_ids: list[int]) -> None:
        """Accept writes tagged `request_id` into exactly `block_ids` until `release`.

        Raises TransferError when it cannot (e.g. the pool is not registered).
        """

    async def wait_complete(self, request_id: str) -> None:
        """Return once the sender's completion notification for `request_id` arrived,
        i.e. every layer of every block is in place. Raises TransferError on failure;
        the caller bounds the wait with its own timeout."""

    def release(self, request_id: str) -> None:
        """Refuse further writes for `request_id`. Idempotent; called on every end
        (finished, aborted, failed), before the blocks go back to the pool."""


class KVSender(Protocol):
    """Prefill side."""

    def begin(self, request_id: str, target: TransferTarget) -> None:
        """Prepare to push `request_id` into `target` (connect, check the layout hash).

        Raises TransferError when the peer cannot be used; nothing is computed then.
        """

    def on_layer_ready(self, ready: LayerReady) -> None:
        """Engine thread, after each layer of each chunk: post the WRITE of
        `ready.block_ids` (prompt blocks from `ready.first_block` on) for
        `ready.layer`. Must not block on the network: it delays the next layer."""

    async def finish(self, request_id: str) -> None:
        """The prefill is done and every layer was posted: wait until all writes
        completed, then notify the receiver. Raises TransferError on failure."""

    def abandon(self, request_id: str) -> None:
        """The request was cancelled or failed: drop what is pending. Idempotent."""


NOT_WIRED_MESSAGE = ("disaggregated transfer not wired yet: this build has no KV transfer "
                     "behind the prefill and decode roles; run the worker with --role both")


class UnwiredTransfer:
    """Both halves, refusing every transfer. Cleanup calls are harmless no-ops."""

    def endpoint(self) -> TransferEndpoint:
        raise TransferNotWiredError(NOT_WIRED_MESSAGE)

    def expect(self, request_id: str, block_ids: list[int]) -> None:
        raise TransferNotWiredError(NOT_WIRED_MESSAGE)

    async def wait_complete(self, request_id: str) -> None:
        raise TransferNotWiredError(NOT_WIRED_MESSAGE)

    def release(self, request_id: str) -> None:
        pass

    def begin(self, request_id: str, target: TransferTarget) -> None:
        raise TransferNotWiredError(NOT_WIRED_MESSAGE)

    def on_layer_ready(self, ready: LayerReady) -> None:
        raise TransferNotWiredError(NOT_WIRED_MESSAGE)

    async def finish(self, request_id: str) -> None:
        raise TransferNotWiredError(NOT_WIRED_MESSAGE)

    def abandon(self, request_id: str) -> None:
        pass
