"""`splitserve worker` on its own, driven over gRPC: isolation, abort, KV events, drain,
and an aggregated worker refusing the disaggregated Prefill RPC clearly."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.proto.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from splitserve.services.engine_api.kv_events import AllCleared, BlockRemoved, BlockStored
from splitserve.services.worker.kv_event_hub import KvEventHub

from .conftest import Proc, free_port

PROMPT = list(range(100, 170))           # 70 tokens: 4 full blocks


@pytest.fixture(scope="module")
def worker(llama_dir):
    port = free_port()
    proc = Proc.start(["splitserve", "worker", "--model", str(llama_dir), "--port", str(port), "--threads", "1",
                       "--kv-cache-gib", "0.05", "--worker-id", "w0", "--remote-prefill-threshold", "32"])
    try:
        proc.wait_for_line(r"worker w0 ready", 120)
        yield f"127.0.0.1:{port}"
    finally:
        assert proc.stop() == 0, proc.output


def run(coro):
    return asyncio.run(coro)


def params(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**{"max_tokens": 4, "ignore_eos": True, **kw})


async def generate(stub, request_id, token_ids, **kw) -> list[worker_pb2.TokenGenerateResponse]:
    request = worker_pb2.TokenGenerateRequest(request_id=request_id, token_ids=token_ids, params=params(**kw))
    return [r async for r in stub.Generate(request)]


def test_bad_requests_are_refused_and_the_worker_lives_on(worker):
    async def main():
        async with grpc.aio.insecure_channel(worker) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            for ids, kw, message in (([1, 32000], {}, "token ids"), ([1, 2**31], {}, "token ids"),
                                     ([], {}, "empty"), ([1, 2], {"max_tokens": 0}, "max_tokens"),
                                     ([1, 2], {"top_p": 1.5}, "top_p"), ([1] * 5000, {}, "context")):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await generate(stub, "bad", ids, **kw)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert message in info.value.details()
            replies = await generate(stub, "good", PROMPT)
            assert sum(len(r.token_ids) for r in replies) == 4 and replies[-1].finished
            stats = await stub.Stats(worker_pb2.StatsRequest())
            assert stats.num_errors >= 6 and stats.num_used_kv_blocks == 0
    run(main())


def test_abort_rpc_ends_the_stream_and_frees_blocks(worker):
    async def main():
        async with grpc.aio.insecure_channel(worker) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            call = stub.Generate(worker_pb2.TokenGenerateRequest(
                request_id="long", token_ids=PROMPT, params=params(max_tokens=3000)))
            first = await call.read()
            assert first.token_ids
            assert (await stub.Abort(worker_pb2.AbortRequest(request_id="long"))).found
            rest = []
            while not rest or not rest[-1].finished:
                rest.append(await call.read())
            assert rest[-1].finished and rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
            assert not (await stub.Abort(worker_pb2.AbortRequest(request_id="long"))).found
            stats = await stub.Stats(worker_pb2.StatsRequest())
            assert stats.num_used_kv_blocks == 0 and stats.num_running == 0
    run(main())


def test_kv_events_replay_and_snapshot(worker):
    async def first_batch(stub, **kw):
        async for batch in stub.KvEvents(worker_pb2.KvEventsRequest(**kw)):
            return batch

    async def main():
        async with grpc.aio.insecure_channel(worker) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            before = (await stub.Stats(worker_pb2.StatsRequest())).last_kv_event_seq
            await generate(stub, "kv", list(range(1000, 1040)), max_tokens=1)    # 2 full blocks
            replay = await first_batch(stub, since_seq=before)
            assert not replay.snapshot and replay.worker_id == "w0"
            assert [e.seq for e in replay.events] == list(range(before + 1, replay.last_seq + 1))
            assert len([e for e in replay.events if e.HasField("stored")]) == 2
            snap = await first_batch(stub, snapshot=True)
            assert snap.snapshot and snap.last_seq == replay.last_seq
            cached = {e.stored.block_hashes[0] for e in snap.events}
            assert {e.stored.block_hashes[0] for e in replay.events if e.HasField("stored")} <= cached
            future = await first_batch(stub, since_seq=replay.last_seq + 100)    # another instance's seq
            assert future.snapshot
            # Live: a subscriber sees events published after it connected.
            stream = stub.KvEvents(worker_pb2.KvEventsRequest(since_seq=snap.last_seq))
            assert not (await stream.read()).events
            await generate(stub, "kv2", list(range(2000, 2020)), max_tokens=1)
            live = await asyncio.wait_for(stream.read(), 5)
            assert live.events[0].seq == snap.last_seq + 1 and live.events[0].HasField("stored")
            stream.cancel()
    run(main())


def test_aggregated_worker_refuses_prefill_and_prefills_locally(worker):
    async def main():
        async with grpc.aio.insecure_channel(worker) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Prefill(worker_pb2.PrefillRequest(request_id="p", token_ids=PROMPT, params=params()))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "no KV transfer" in info.value.details() and "--role prefill" in info.value.details()
            # A role-both worker ignores a prefill peer: it prefills everything itself.
            request = worker_pb2.TokenGenerateRequest(
                request_id="d", token_ids=list(range(3000, 3100)), params=params(),
                prefill_peer=worker_pb2.PrefillPeer(worker_id="p0", address="127.0.0.1:9"))
            replies = [r async for r in stub.Generate(request)]
            assert replies[-1].finished and not replies[-1].prefilled_remotely
            stats = await stub.Stats(worker_pb2.StatsRequest())
            assert stats.num_used_kv_blocks == 0 and stats.num_remote_prefill == 0
            assert stats.num_remote_prefills == 0 and stats.num_local_prefills >= 1
            assert stats.num_prefill_fallbacks == 0 and stats.num_held_prefills == 0
            assert (await stub.Describe(worker_pb2.DescribeRequest())).transfer_backend == ""
    run(main())


def test_drain_stops_admission(worker):
    # Runs last in this module: the worker admits nothing afterwards.
    async def main():
        async with grpc.aio.insecure_channel(worker) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            ok = await health.Check(health_pb2.HealthCheckRequest(service="splitserve.v1.Worker"))
            assert ok.status == health_pb2.HealthCheckResponse.SERVING
            info = await stub.Describe(worker_pb2.DescribeRequest())
            assert info.role == worker_pb2.WORKER_ROLE_BOTH and info.max_model_len == 4096
            assert (await stub.Drain(worker_pb2.DrainRequest())).num_in_flight == 0
            status = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(stub, "late", PROMPT)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in info.value.details()
            assert (await stub.Stats(worker_pb2.StatsRequest())).draining
    run(main())


def test_kv_event_hub_buffer_and_snapshot():
    hub = KvEventHub(capacity=3)
    h = [bytes([i]) * 32 for i in range(4)]
    hub.publish([BlockStored(1, (h[0],), None, (1, 2)), BlockStored(2, (h[1],), h[0], (3, 4))])
    assert [e.seq for e in hub.read(0).events] == [1, 2]
    hub.publish([BlockRemoved(3, (h[1],)), BlockStored(4, (h[2],), h[0], (5, 6))])
    assert [e.seq for e in hub.read(1).events] == [2, 3, 4]
    gone = hub.read(0)                       # seq 1 fell out of the buffer
    assert gone.snapshot and gone.last_seq == 4
    assert [e.block_hashes for e in gone.events] == [(h[0],), (h[2],)]
    assert all(e.seq == 0 for e in gone.events)
    hub.publish([AllCleared(5)])
    assert hub.read(0, snapshot=True).events == [] and hub.read(4).events == [AllCleared(5)]
