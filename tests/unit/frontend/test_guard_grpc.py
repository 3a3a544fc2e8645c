"""GuardInterceptor, the public gRPC API's gatekeeper, on a real grpc.aio server on 127.0.0.1.

Behind it: the standard health service (a unary call) and a fake Inference service
whose Generate streams two messages, holding between them while a test needs a call
open. Checked: a call without a valid key ends UNAUTHENTICATED before the service
sees it; streaming calls are limited per key (or per peer address without keys) and
give their slot back when the stream ends; the rate limiter's clock is stepped, not
slept on; refusals are counted by reason. `_peer_host` names a client as HTTP does.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from splitserve.proto.v1 import inference_pb2, inference_pb2_grpc
from splitserve.services.frontend.grpc.guard import GuardInterceptor, _peer_host
from splitserve.services.frontend.guard import Guard
from splitserve.services.frontend.limits import Rejection
from splitserve.testing.clock import FakeClock

from .conftest import counted_guard

KEY, OTHER_KEY = "sk-unit-1", "sk-unit-2"


class FakeInference(inference_pb2_grpc.InferenceServicer):
    """Streams "a" then "b"; a request for model "hold" waits for `release` in between."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.holding = asyncio.Event()
        self.num_calls = 0

    async def Generate(self, request, context):
        self.num_calls += 1
        yield inference_pb2.GenerateResponse(text="a")
        if request.model == "hold":
            self.holding.set()
            await self.release.wait()
        yield inference_pb2.GenerateResponse(text="b")


@contextlib.asynccontextmanager
async def guarded(guard: Guard):
    server = grpc.aio.server(interceptors=[GuardInterceptor(guard)])
    service = FakeInference()
    inference_pb2_grpc.add_InferenceServicer_to_server(service, server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield service, channel
    finally:
        await server.stop(0)


def _metadata(key: str | None):
    return () if key is None else (("authorization", f"Bearer {key}"),)


async def _generate(channel, key: str | None = None, model: str = "") -> str:
    stub = inference_pb2_grpc.InferenceStub(channel)
    call = stub.Generate(inference_pb2.GenerateRequest(model=model, text="hi"), metadata=_metadata(key))
    return "".join([r.text async for r in call])


async def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code()


def test_calls_without_a_valid_key_are_unauthenticated_before_the_service():
    guard, rejected = counted_guard((KEY,))

    async def main():
        async with guarded(guard) as (service, channel):
            health = health_pb2_grpc.HealthStub(channel)
            codes = [await _code(_generate(channel)), await _code(_generate(channel, "sk-wrong")),
                     await _code(health.Check(health_pb2.HealthCheckRequest()))]
            served = await _generate(channel, KEY)
            checked = await health.Check(health_pb2.HealthCheckRequest(), metadata=_metadata(KEY))
            return codes, service.num_calls, served, checked.status

    codes, num_calls, served, status = asyncio.run(main())
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 3
    assert num_calls == 1 and served == "ab"
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert rejected("grpc", "auth") == 3


def test_streams_are_limited_per_key_and_give_their_slot_back():
    guard, rejected = counted_guard((KEY, OTHER_KEY), max_concurrent_per_key=1)

    async def main():
        async with guarded(guard) as (service, channel):
            held = asyncio.create_task(_generate(channel, KEY, model="hold"))
            await service.holding.wait()
            same_key = await _code(_generate(channel, KEY))
            other_key = await _generate(channel, OTHER_KEY)
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                     metadata=_metadata(KEY))   # unary: not limited
            service.release.set()
            first = await held
            return same_key, other_key, health.status, first, await _generate(channel, KEY)

    same_key, other_key, health, first, again = asyncio.run(main())
    assert same_key == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (other_key, first, again) == ("ab", "ab", "ab")
    assert health == health_pb2.HealthCheckResponse.SERVING
    assert rejected("grpc", "concurrency") == 1
    assert guard.limiter.num_in_flight() == 0                 # leak check


def test_without_keys_the_peer_address_is_the_client():
    guard, rejected = counted_guard(max_concurrent_per_key=1)

    async def main():
        async with guarded(guard) as (service, channel):
            held = asyncio.create_task(_generate(channel, model="hold"))
            await service.holding.wait()
            refused = await _code(_generate(channel))
            # The slot is booked under the name HTTP gives this client: its HTTP requests wait too.
            as_http = guard.limiter.admit("127.0.0.1")
            service.release.set()
            await held
            return refused, as_http

    refused, as_http = asyncio.run(main())
    assert refused == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert as_http is not None and as_http.reason is Rejection.CONCURRENCY
    assert guard.limiter.num_in_flight() == 0


def test_the_rate_limit_refills_on_the_injected_clock():
    clock = FakeClock(100.0)
    guard, rejected = counted_guard((KEY,), clock=clock, rate_limit=1.0, rate_limit_burst=1, max_concurrent_per_key=0)

    async def main():
        async with guarded(guard) as (_, channel):
            first = await _generate(channel, KEY)
            limited = await _code(_generate(channel, KEY))
            clock.advance(1.0)
            return first, limited, await _generate(channel, KEY)

    first, limited, refilled = asyncio.run(main())
    assert (first, refilled) == ("ab", "ab")
    assert limited == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert rejected("grpc", "rate_limit") == 1


@pytest.mark.parametrize("peer, host", [("ipv4:127.0.0.1:5000", "127.0.0.1"), ("ipv6:[::1]:5000", "::1"),
                                        ("unix:/tmp/socket", "/tmp/socket"), ("", "unknown")])
def test_peer_host_names_the_client_as_http_does(peer, host):
    assert _peer_host(SimpleNamespace(peer=lambda: peer)) == host
