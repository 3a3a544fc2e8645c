"""Decode side: keep the blocks of a given-up remote prefill out of the pool while a
prefill worker may still write into them.

NIXL writes are one-sided: once a decode worker gave a prefill worker a grant, it
cannot stop bytes from landing in the granted blocks. When it gives the request up
(the client went away, the prefill failed or timed out, it prefills locally
instead) the engine leaves those blocks owned by the transfer
(scheduler.transfer_owned) instead of freeing them, and `WriteFences` gives them
back (`release_transfer`) once every prefill worker the request was sent to
answered FenceTransfer (it posts nothing more for the request and none of its
writes is in flight), or when the last grant has run out: a sender posts no write
past its grant's deadline and gives up a little after it (GRANT_GRACE_S,
transfer.py). A block freed earlier could be handed to another request and then
overwritten.

When a retry on another prefill worker succeeds, the earlier worker's fence is
asked for too, in the background: both write the same prompt's KV into the same
blocks, so its late writes change nothing while the request holds them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from splitserve.proto.v1 import worker_pb2

from splitserve.services.worker.engine_loop import EngineLoop

log = logging.getLogger(__name__)

FENCE_TIMEOUT_S = 2.0       # how long to wait for a prefill worker's FenceTransfer answer
RETRY_S = 0.1               # between FenceTransfer attempts on an unavailable peer


class WriteFences:
    """Asks prefill workers to stop writing a request, and frees its fenced blocks after.

    `clock` and `sleep` tell and wait out time (time.monotonic and asyncio.sleep; a test
    passes its own, so a grant runs out without waiting for it)."""

    def __init__(self, loop: EngineLoop, peers, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.loop = loop
        self.peers = peers                # PeerChannels (remote_prefill.py)
        self.clock = clock
        self.sleep = sleep
        self.num_confirmed = 0            # fences freed on every sender's answer
        self.num_waited_out = 0           # fences freed when the grant ran out
        self._tasks: set[asyncio.Task] = set()

    def ask(self, address: str, request_id: str) -> asyncio.Task:
        """FenceTransfer on `address` (in the background); the task's result: drained or not."""
        return self._track(self._ask(address, request_id))

    def release_when_stopped(self, request_id: str, asks: list[asyncio.Task], expires_at: float) -> None:
        """The engine left `request_id`'s granted blocks to the transfer: free them once
        every ask says drained, else at `expires_at` (on `clock`)."""
        self._track(self._release(request_id, list(asks), expires_at))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _track(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _ask(self, address: str, request_id: str) -> bool:
        deadline = self.clock() + FENCE_TIMEOUT_S
        while True:
            try:
                reply = await self.peers.stub(address).FenceTransfer(
                    worker_pb2.FenceTransferRequest(request_id=request_id),
                    timeout=max(0.05, deadline - self.clock()))
                return reply.drained
            except grpc.aio.AioRpcError as exc:
                if _nothing_listens(exc):
                    return True       # the prefill process is gone, and its writes with it
                # A connection that broke as its peer died reads UNAVAILABLE too: the next
                # attempt tells a gone process (refused) from an unreachable one.
                if exc.code() != grpc.StatusCode.UNAVAILABLE or self.clock() + RETRY_S >= deadline:
                    log.warning("request %s: prefill worker %s did not confirm it stopped writing (%s: %s)",
                                request_id, address, exc.code().name, exc.details())
                    return False
            await self.sleep(RETRY_S)

    async def _release(self, request_id: str, asks: list[asyncio.Task], expires_at: float) -> None:
        drained = all(await asyncio.gather(*asks)) if asks else True
        if drained:
            self.num_confirmed += 1
        else:
            self.num_waited_out += 1
            wait = max(0.0, expires_at - self.clock())
            log.warning("request %s: its granted KV blocks stay fenced %.1f s more, until no grant "
                        "for them is left", request_id, wait)
            await self.sleep(wait)
        self.loop.post(lambda e: e.release_transfer(request_id))


def _nothing_listens(exc: grpc.aio.AioRpcError) -> bool:
    """A refused connection: no process serves that address (a hung or unreachable one is
    a timeout instead, and must be waited out)."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and "connection refused" in (exc.details() or "").lower()
