"""Fixtures of the worker's in-process unit tests: the built-in engine on the random Llama, and the
fakes of the decode side's KV-transfer tests (remote_prefill.py, write_fences.py).

`engine` (one per module; loading costs about a second) serves the EngineLoop and
WorkerService tests, which must leave it idle (`assert_engine_idle`), so the next test
starts from an empty pool.

The code under test is real, and so is the engine: one small built-in engine on the random
Llama checkpoint, driven by a real EngineLoop, so every test can end by checking that
the engine's pool is all free. What is faked are the collaborators across the
network: prefill workers (`FakePrefillWorker`, reached through `FakePeers` in place of
PeerChannels), the transfer's receiving half (`FakeReceiver`: a Prefill "fills" the
blocks by completing the request), and time (`FakeClock`: a grant runs out when the
test moves the clock, never by waiting).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import grpc
import pytest

from splitserve.proto.v1 import worker_pb2
from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.builtin import BuiltinEngine
from splitserve.services.engine.sampler import SampledToken
from splitserve.services.worker.output_messages import encode_first_token
from splitserve.services.worker.engine_loop import EngineLoop
from splitserve.kvtransfer.sender_receiver import TransferEndpoint, TransferError, TransferGrant
from splitserve.testing.clock import FakeClock

NUM_KV_BLOCKS = 24      # block size 16: a 256-token context


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class FakeReceiver:
    """KVReceiver without a network: `complete` / `fail` end what `wait_complete` awaits."""

    backend = "fake"

    def __init__(self) -> None:
        self.granted: dict[str, list[int]] = {}      # open grants: request id -> block ids
        self.grants: list[tuple[str, list[int]]] = []   # every grant given, in order
        self.released: list[str] = []
        self._done: dict[str, asyncio.Future] = {}

    def endpoint(self) -> TransferEndpoint:
        return TransferEndpoint("decode-0", b"metadata", b"layout", "inc-1")

    def expect(self, request_id: str, block_ids: list[int], ttl_s: float) -> TransferGrant:
        self.granted[request_id] = list(block_ids)
        self.grants.append((request_id, list(block_ids)))
        self._done[request_id] = asyncio.get_running_loop().create_future()
        return TransferGrant("inc-1", 2e9)

    def complete(self, request_id: str, payload: bytes) -> None:
        self._done[request_id].set_result(payload)

    def fail(self, request_id: str, exc: Exception) -> None:
        self._done[request_id].set_exception(exc)

    async def wait_complete(self, request_id: str) -> bytes:
        return await self._done[request_id]

    def release(self, request_id: str) -> None:
        self.granted.pop(request_id, None)
        self._done.pop(request_id, None)
        self.released.append(request_id)

    def num_open(self) -> int:
        return len(self.granted)


class FakePrefillWorker:
    """A prefill worker's Prefill and FenceTransfer RPCs, answering as the test sets them.

    `prefill`: "ok" fills the blocks (completes the receiver with `first_token`),
    "refuse" fails the call (UNAVAILABLE), "transfer_error" answers but fails the
    transfer, "hang" never answers (or DEADLINE_EXCEEDED at the call's timeout, as gRPC does).
    A `kv_handoff` Prefill (handoff.py) answers `handoff` as its kv_transfer_params JSON instead
    of filling blocks. `fence_answers` are FenceTransfer's answers in turn
    (True / False: drained or not; an AioRpcError is raised); the last one repeats. With
    `fence_gate`, FenceTransfer answers once the gate opens. `on_prefill` runs at each
    Prefill call (e.g. to move the clock)."""

    def __init__(self, address: str, receiver: FakeReceiver) -> None:
        self.address = address
        self.receiver = receiver
        self.prefill = "ok"
        self.first_token = 7
        self.fence_answers: list[bool | grpc.aio.AioRpcError] = [True]
        self.fence_gate: asyncio.Event | None = None     # set: FenceTransfer answers once it opens
        self.on_prefill = None
        self.handoff: object = {"remote_engine_id": address, "remote_block_ids": [0, 1]}
        self.prefill_requests: list[worker_pb2.PrefillRequest] = []
        self.fenced: list[str] = []
        self.entered = asyncio.Event()

    async def Prefill(self, request: worker_pb2.PrefillRequest, timeout: float | None = None):
        self.prefill_requests.append(request)
        self.entered.set()
        if self.on_prefill is not None:
            self.on_prefill()
        if self.prefill == "refuse":
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"{self.address} is draining")
        if self.prefill == "hang":
            try:
                await asyncio.wait_for(asyncio.Event().wait(), timeout)
            except asyncio.TimeoutError:
                raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        if request.kv_handoff:
            return worker_pb2.PrefillResponse(first_token_id=self.first_token,
                                              kv_transfer_params_json=json.dumps(self.handoff))
        if self.prefill == "transfer_error":
            self.receiver.fail(request.request_id, TransferError("the sender lost its connection"))
        else:
            self.receiver.complete(request.request_id, encode_first_token(SampledToken(self.first_token)))
        return worker_pb2.PrefillResponse(first_token_id=self.first_token)

    async def FenceTransfer(self, request: worker_pb2.FenceTransferRequest, timeout: float | None = None):
        self.fenced.append(request.request_id)
        if self.fence_gate is not None:
            await self.fence_gate.wait()
        answer = self.fence_answers[0] if len(self.fence_answers) == 1 else self.fence_answers.pop(0)
        if isinstance(answer, grpc.aio.AioRpcError):
            raise answer
        return worker_pb2.FenceTransferResponse(drained=answer)


class FakePeers:
    """Stands in for PeerChannels: `stub(address)` is that address's FakePrefillWorker."""

    def __init__(self, receiver: FakeReceiver) -> None:
        self.receiver = receiver
        self.workers: dict[str, FakePrefillWorker] = {}

    def add(self, address: str) -> FakePrefillWorker:
        worker = self.workers[address] = FakePrefillWorker(address, self.receiver)
        return worker

    def stub(self, address: str) -> FakePrefillWorker:
        return self.workers[address]


@pytest.fixture(scope="session")
def small_engine(llama_dir) -> BuiltinEngine:
    """Shared by the tests (each uses its own prompts); every test leaves it idle."""
    engine = BuiltinEngine.start(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS))
    yield engine
    engine.close()


@dataclass(frozen=True, slots=True)
class EngineState:
    """What a test checks of the engine's blocks (read on the engine thread)."""

    num_used_blocks: int
    num_fenced_blocks: int
    transfer_owned: tuple[str, ...]       # request ids whose blocks a transfer owns
    reserved: tuple[str, ...]             # reservations waiting for a remote prefill
    no_refs: bool                         # every block's reference count is 0 (none negative)

    @property
    def all_free(self) -> bool:
        return self.num_used_blocks == 0 and self.no_refs and not self.transfer_owned and not self.reserved


def read_state(engine: BuiltinEngine) -> EngineState:
    pool, sched = engine.core.pool, engine.core.scheduler
    return EngineState(pool.num_used_blocks, engine.core.num_fenced_blocks, tuple(sched.transfer_owned),
                       tuple(sched.remote), not any(pool.ref_counts))


@pytest.fixture
def engine_loop(small_engine):
    loop = EngineLoop(small_engine)
    loop.start()
    yield loop
    loop.stop()
    # A failed test must not fail the next ones: whatever it left goes back (the tests
    # themselves assert that nothing is left).
    sched = small_engine.core.scheduler
    for seq in [*sched.running, *sched.waiting, *sched.remote.values()]:
        small_engine.abort(seq.request_id)
    for request_id in list(sched.transfer_owned):
        small_engine.release_transfer(request_id)
    small_engine.step()                     # drains the abort outputs


@pytest.fixture
def engine_state(engine_loop):
    """`await engine_state()`: the engine's EngineState, after every job posted so far."""
    return lambda: engine_loop.call(read_state)


@pytest.fixture
def receiver() -> FakeReceiver:
    return FakeReceiver()


@pytest.fixture
def peers(receiver) -> FakePeers:
    return FakePeers(receiver)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(now=1000.0)


@pytest.fixture
def auto_clock() -> FakeClock:
    """A FakeClock whose `sleep` moves it (for waits a test need not watch)."""
    return FakeClock(now=1000.0, auto_advance=True)


SERVICE_NUM_KV_BLOCKS = 64      # 1024 tokens of context: room for every prompt of the service tests


@pytest.fixture(scope="module")
def engine(llama_dir):
    engine = BuiltinEngine.start(EngineConfig(model=str(llama_dir), num_kv_blocks=SERVICE_NUM_KV_BLOCKS,
                                              num_threads=1))
    try:
        yield engine
    finally:
        engine.close()


def assert_engine_idle(engine: BuiltinEngine) -> None:
    """The leak check: no request left and every block free (cached blocks count as free)."""
    assert not engine.has_unfinished()
    assert engine.core.pool.num_used_blocks == 0, engine.core.pool.num_used_blocks
