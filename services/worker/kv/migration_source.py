"""Source side of a live migration (issue 41): send a suspended request's KV to another decode worker.

The frontend asks the decode worker serving a request to suspend it (the Suspend call): the
engine stops decoding it and keeps its KV blocks (engine_api KVMigrationEngine), for at most a
hold. The decode worker taking the request over reserves blocks for prompt + output so far and
sends a Prefill naming the suspended request (`migrate_request_id`); this side reports those
blocks to its sender for the KV of all tokens but the last, exactly as a prefill reports its
layers, and completes the transfer with `MIGRATED_KV` instead of a first token. Whatever the
outcome, the blocks are freed once the send is over (or when the hold expires first), so a
migration never leaves a block behind on either side. The destination half is
remote_prefill.RemotePrefill.migrate.
"""

from __future__ import annotations

import asyncio
import logging

from splitserve.kvtransfer.sender_receiver import KVSender, TransferError, TransferTarget
from splitserve.services.worker.engine_loop import EngineLoop
from splitserve.services.worker.kv.prefill_server import grant_time_left
from splitserve.services.worker.output_messages import MIGRATED_KV

log = logging.getLogger(__name__)

DEFAULT_HOLD_S = 30.0      # how long a suspended request's KV waits for its destination to read it


class SuspendedRequests:
    """The requests suspended on this worker, each until it is sent or its hold expires."""

    def __init__(self, loop: EngineLoop) -> None:
        self._loop = loop
        self._expiries: dict[str, asyncio.TimerHandle] = {}

    async def suspend(self, request_id: str, hold_s: float) -> int | None:
        """Suspend a running request; the number of tokens whose KV is held, or None."""
        num_tokens = await self._loop.call(lambda e: e.suspend(request_id))
        if num_tokens is not None:
            self._expiries[request_id] = asyncio.get_running_loop().call_later(
                hold_s or DEFAULT_HOLD_S, self._expire, request_id)
        return num_tokens

    def _expire(self, request_id: str) -> None:
        if self._expiries.pop(request_id, None) is not None:
            log.info("request %s: suspended for a migration that did not read its KV in time; freed", request_id)
            self._loop.post(lambda e: e.release_suspended(request_id))

    def take(self, request_id: str) -> bool:
        """Claim a suspended request for one send (its hold stops); False when none is held."""
        expiry = self._expiries.pop(request_id, None)
        if expiry is not None:
            expiry.cancel()
        return expiry is not None

    def __len__(self) -> int:
        return len(self._expiries)

    async def send(self, sender: KVSender, transfer_id: str, request_id: str, token_ids: list[int],
                   target: TransferTarget) -> int:
        """Push the KV of the first len(token_ids) - 1 tokens of suspended `request_id` into
        `target` under `transfer_id`; the number of tokens sent. Raises TransferError (or the
        engine's InvalidRequestError: other tokens, nothing held); the blocks are freed either way."""
        if not self.take(request_id):
            raise TransferError(f"no suspended request {request_id!r} here (it ended, or its hold expired)")
        try:
            sender.begin(transfer_id, target, len(token_ids) - 1)
            async with asyncio.timeout(grant_time_left(target)):
                num_tokens = await self._loop.call(
                    lambda e: e.export_suspended(request_id, transfer_id, token_ids, sender.on_layer_ready))
                await sender.finish(transfer_id, MIGRATED_KV)
            return num_tokens
        except TimeoutError:
            sender.abandon(transfer_id)
            raise TransferError(f"migration of {request_id!r}: the receiver's grant expired before the "
                                "transfer completed") from None
        except BaseException:
            sender.abandon(transfer_id)
            raise
        finally:
            self._loop.post(lambda e: e.release_suspended(request_id))
