"""WorkerService in-process: its handlers behind a real grpc.aio server on 127.0.0.1.

An aggregated worker (role both, the transfer server.py builds for it) over a real
engine, called through the generated stub: UNAVAILABLE until the engine is attached
and after close; Describe and Stats report the engine; bad input is INVALID_ARGUMENT
with the engine's message and the worker serves on; Abort and a cancelled call end
a running request; Drain refuses new work while running calls go on; a KV-handoff Prefill
(`--kv-connector nixl-vllm`) to an engine without one is refused with what to fix. Every test
ends with the engine idle. The process-level behaviour (signals, etcd, the session
stream) is in tests/integration/serving/test_worker.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from splitserve.services.worker.health import WorkerHealthServicer

from splitserve.proto.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from splitserve.services.worker.server import build_transfer
from splitserve.services.worker.service import Role, WorkerOptions, WorkerService

from .conftest import SERVICE_NUM_KV_BLOCKS as NUM_KV_BLOCKS, assert_engine_idle

PROMPT = list(range(100, 170))            # 70 tokens: 4 full blocks
MAX_POLLS = 500                           # Stats round trips to wait for a cancellation to land


@dataclass
class Served:
    service: WorkerService
    stub: worker_pb2_grpc.WorkerStub
    health: health_pb2_grpc.HealthStub

    async def stats(self) -> worker_pb2.StatsResponse:
        return await self.stub.Stats(worker_pb2.StatsRequest())

    async def health_status(self) -> int:
        return (await self.health.Check(health_pb2.HealthCheckRequest(service=""))).status

    async def start_long(self, request_id: str):
        """A Generate far from done (500 tokens): the call, once its first reply came."""
        call = self.stub.Generate(_request(request_id, max_tokens=500))
        return call, await call.read()

    async def abort(self, request_id: str) -> bool:
        return (await self.stub.Abort(worker_pb2.AbortRequest(request_id=request_id))).found


@contextlib.asynccontextmanager
async def serving(engine, attach: bool = True):
    """A WorkerService on a free loopback port; stopped and closed on the way out.

    Each test gets its own service over the module's engine (the engine keeps every
    service's KV event subscription; an old one only buffers events nobody reads)."""
    health = WorkerHealthServicer()
    service = WorkerService(WorkerOptions("w-unit", Role.BOTH), health)
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        if attach:
            await service.attach(engine, *build_transfer(Role.BOTH, engine))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Served(service, worker_pb2_grpc.WorkerStub(channel), health_pb2_grpc.HealthStub(channel))
    finally:
        if service.loop is not None:
            await asyncio.to_thread(service.loop.stop)      # as server.py does, off the event loop
        await server.stop(0)
        await service.close()


def _request(request_id: str, token_ids=PROMPT, **params) -> worker_pb2.TokenGenerateRequest:
    return worker_pb2.TokenGenerateRequest(request_id=request_id, token_ids=token_ids, params=common_pb2.SamplingParams(
        **{"max_tokens": 4, "ignore_eos": True, **params}))


async def _generate(stub, request_id: str, token_ids=PROMPT, **params) -> list[worker_pb2.TokenGenerateResponse]:
    return [r async for r in stub.Generate(_request(request_id, token_ids, **params))]


async def _read_to_the_end(call) -> list[worker_pb2.TokenGenerateResponse]:
    """The rest of a call already read with read() (grpc.aio forbids mixing in `async for`)."""
    replies = []
    while (reply := await call.read()) is not grpc.aio.EOF:
        replies.append(reply)
    return replies


async def _refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


def test_unavailable_until_the_engine_is_attached(engine):
    async def main():
        async with serving(engine, attach=False) as w:
            for call in (w.stats(), w.stub.Describe(worker_pb2.DescribeRequest()), _generate(w.stub, "early")):
                error = await _refused(call)
                assert error.code() == grpc.StatusCode.UNAVAILABLE and "not ready" in error.details()
            await w.service.attach(engine, *build_transfer(Role.BOTH, engine))
            assert await w.health_status() == health_pb2.HealthCheckResponse.SERVING
            return await w.stats()

    stats = asyncio.run(main())
    assert stats.worker_id == "w-unit" and stats.num_errors == 3
    assert_engine_idle(engine)


def test_describe_and_stats_report_the_engine(engine):
    async def main():
        async with serving(engine) as w:
            return await w.stub.Describe(worker_pb2.DescribeRequest()), await w.stats()

    described, stats = asyncio.run(main())
    assert (described.worker_id, described.role) == ("w-unit", worker_pb2.WORKER_ROLE_BOTH)
    assert described.instance_id and described.transfer_backend == ""        # aggregated: nothing to transfer
    assert (described.block_size, described.num_kv_blocks, described.vocab_size) == (16, NUM_KV_BLOCKS, 32000)
    assert described.max_model_len == engine.describe().max_model_len and described.device == "cpu"
    assert (stats.role, stats.num_kv_blocks, stats.num_used_kv_blocks) == (worker_pb2.WORKER_ROLE_BOTH,
                                                                           NUM_KV_BLOCKS, 0)
    assert not stats.draining and stats.num_in_flight == 0 and stats.num_transfer_reservations == 0
    assert_engine_idle(engine)


def test_bad_input_is_invalid_argument_and_the_worker_serves_on(engine):
    async def main():
        async with serving(engine) as w:
            for ids, params, message in (([1, 32000], {}, "token ids"), ([], {}, "empty"),
                                         ([1, 2], {"max_tokens": 0}, "max_tokens"),
                                         ([1, 2], {"top_p": 1.5}, "top_p")):
                error = await _refused(_generate(w.stub, "bad", ids, **params))
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
                assert message in error.details()
            replies = await _generate(w.stub, "good")
            return replies, await w.stats(), await w.health_status()

    replies, stats, health = asyncio.run(main())
    assert sum(len(r.token_ids) for r in replies) == 4
    assert replies[-1].finished and replies[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert stats.num_errors == 4 and stats.num_used_kv_blocks == 0
    assert health == health_pb2.HealthCheckResponse.SERVING
    assert_engine_idle(engine)


def test_abort_ends_a_running_generate_and_frees_its_blocks(engine):
    async def main():
        async with serving(engine) as w:
            call, first = await w.start_long("long")
            busy = await w.stats()
            found = await w.abort("long")
            rest = await _read_to_the_end(call)
            return first, busy, found, rest, await w.abort("long"), await w.stats()

    first, busy, found, rest, again, idle = asyncio.run(main())
    assert first.token_ids and busy.num_running == 1 and busy.num_used_kv_blocks > 0
    assert found and not again
    assert rest[-1].finished and rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert idle.num_used_kv_blocks == 0 and idle.num_running == 0 and idle.num_in_flight == 0
    assert idle.num_aborted == busy.num_aborted + 1
    assert_engine_idle(engine)


def test_a_cancelled_call_aborts_its_request(engine):
    async def main():
        async with serving(engine) as w:
            call, _ = await w.start_long("cancelled")
            before = await w.stats()
            call.cancel()
            for _ in range(MAX_POLLS):        # the cancellation reaches the handler asynchronously
                after = await w.stats()
                if after.num_in_flight == 0 and after.num_running == 0:
                    return before, after
            raise AssertionError(f"the cancelled request still runs: {after}")

    before, after = asyncio.run(main())
    assert before.num_running == 1 and before.num_in_flight == 1
    assert after.num_aborted == before.num_aborted + 1 and after.num_used_kv_blocks == 0
    assert_engine_idle(engine)


def test_drain_refuses_new_work_while_running_calls_go_on(engine):
    async def main():
        async with serving(engine) as w:
            call, _ = await w.start_long("running")
            drained = await w.stub.Drain(worker_pb2.DrainRequest())
            refused = await _refused(_generate(w.stub, "late"))
            still_running = await call.read()
            stats, health = await w.stats(), await w.health_status()
            assert await w.abort("running")             # Abort is still admitted
            rest = await _read_to_the_end(call)
            return drained, refused, still_running, stats, health, rest

    drained, refused, still_running, stats, health, rest = asyncio.run(main())
    assert drained.num_in_flight == 1
    assert refused.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.details()
    assert still_running.token_ids and not still_running.finished
    assert stats.draining and health == health_pb2.HealthCheckResponse.NOT_SERVING
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert_engine_idle(engine)


def test_after_close_every_call_is_unavailable(engine):
    async def main():
        async with serving(engine) as w:
            assert (await w.stats()).worker_id == "w-unit"
            await w.service.close()
            errors = [await _refused(call) for call in (w.stats(), _generate(w.stub, "closed"))]
            return errors, await w.health_status()

    errors, health = asyncio.run(main())
    assert [e.code() for e in errors] == [grpc.StatusCode.UNAVAILABLE] * 2, errors
    assert health == health_pb2.HealthCheckResponse.NOT_SERVING
    assert_engine_idle(engine)


def test_a_handoff_prefill_to_a_worker_whose_engine_does_not_hand_off_is_refused_clearly(engine):
    """`--kv-connector nixl-vllm` on one pool only: the prefill worker says what to fix, and serves on."""
    async def main():
        async with serving(engine) as w:
            error = await _refused(w.stub.Prefill(worker_pb2.PrefillRequest(
                request_id="handoff-1", token_ids=PROMPT, params=common_pb2.SamplingParams(max_tokens=1),
                kv_handoff=True)))
            return error, await _generate(w.stub, "after")

    error, replies = asyncio.run(main())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not hand KV off" in error.details() and "same --kv-connector" in error.details()
    assert replies[-1].finished
    assert_engine_idle(engine)


def test_handoff_transfer_names_the_connector_and_refuses_splitserves_transfer():
    from splitserve.kvtransfer.sender_receiver import TransferNotWiredError
    from splitserve.services.worker.kv.handoff import HandoffTransfer

    handoff = HandoffTransfer("nixl-vllm", b"smollm2|torch.float32|engine=vllm")
    assert handoff.backend == "nixl-vllm"
    assert handoff.endpoint().layout_hash == b"handoff:nixl-vllm:smollm2|torch.float32|engine=vllm"
    assert handoff.num_open() == 0 and asyncio.run(handoff.fence("r", 1.0))
    with pytest.raises(TransferNotWiredError, match="moves KV itself \\(nixl-vllm\\)"):
        handoff.expect("r", [1, 2], 5.0)
