"""SuspendedRequests (services/worker/kv/migration_source.py): a suspended request's KV is freed when
its hold expires unless a send claimed it first, and a claimed one is never freed by the timer.
The engine loop is a stand-in that runs each job at once on this thread (the engine hooks
themselves: tests/integration/engine/test_live_migration_hooks.py)."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.kvtransfer.sender_receiver import TransferEndpoint, TransferError, TransferTarget
from splitserve.services.worker.kv.migration_source import SuspendedRequests
from splitserve.testing.waiting import async_wait_until


class _Engine:
    def __init__(self) -> None:
        self.released: list[str] = []

    def suspend(self, request_id: str) -> int | None:
        return None if request_id == "prefilling" else 41

    def release_suspended(self, request_id: str) -> bool:
        self.released.append(request_id)
        return True


class _Loop:
    """Stand-in for EngineLoop: `call` and `post` run the job at once."""

    def __init__(self, engine: _Engine) -> None:
        self.engine = engine

    async def call(self, fn):
        return fn(self.engine)

    def post(self, fn) -> None:
        fn(self.engine)


def test_a_hold_that_expires_frees_the_kv_and_a_claim_stops_the_timer():
    async def main():
        engine = _Engine()
        held = SuspendedRequests(_Loop(engine))
        assert await held.suspend("prefilling", 0.05) is None and len(held) == 0
        assert await held.suspend("a", 0.05) == 41
        assert await held.suspend("b", 0.05) == 41
        assert held.take("b") and not held.take("b")        # claimed once: its timer is off
        await async_wait_until(lambda: engine.released == ["a"], timeout=5, interval=0.01,
                               what="the expired hold to free a's KV")
        assert len(held) == 0 and not held.take("a")
        await asyncio.sleep(0.1)                             # past b's hold: the claim kept it
        assert engine.released == ["a"]

    asyncio.run(main())


def test_a_send_of_nothing_held_is_refused():
    async def main():
        held = SuspendedRequests(_Loop(_Engine()))
        with pytest.raises(TransferError, match="no suspended request"):
            await held.send(None, "t", "gone", [1, 2, 3], TransferTarget(TransferEndpoint("x", b"", b"")))

    asyncio.run(main())
