"""The engine contract (services/engine_api/contract.py): both engines implement all of it, with the
contract's signatures, and the worker serves any engine that does.

The worker half runs the real EngineLoop and WorkerService over the stand-in engine
(splitserve/testing/fake_engine.py): a Generate call streams its tokens, Stats and Describe
report the engine's own load and layout, a KV event reaches the worker's hub, and a failing
step fails the open streams while the loop carries on.
"""

from __future__ import annotations

import asyncio
import inspect

import pytest
from grpc_health.v1._async import HealthServicer

from splitserve.proto.v1 import worker_pb2
from splitserve.services.engine.builtin import BuiltinEngine, BuiltinEngineLauncher
from splitserve.services.engine_api.contract import Engine, EngineLauncher
from splitserve.services.engine_vllm.engine import VllmEngine
from splitserve.services.engine_vllm.launcher import VllmEngineLauncher
from splitserve.services.worker.engine_loop import EngineLoop, EngineStepError
from splitserve.services.worker.server import build_transfer
from splitserve.services.worker.service import Role, WorkerOptions, WorkerService
from splitserve.services.worker_protocol.proto_conversion import params_to_proto
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.testing.fake_engine import FakeEngine

CONTRACT_MEMBERS = sorted(name for name in vars(Engine) if not name.startswith("_") and name != "ranks")


def _parameters(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("implementation", [BuiltinEngine, VllmEngine, FakeEngine])
@pytest.mark.parametrize("member", CONTRACT_MEMBERS)
def test_each_engine_implements_the_contract_with_its_signatures(implementation, member):
    assert callable(getattr(implementation, member, None)), f"{implementation.__name__} lacks {member}"
    assert _parameters(getattr(implementation, member)) == _parameters(getattr(Engine, member))


@pytest.mark.parametrize("implementation", [BuiltinEngine, VllmEngine, FakeEngine])
def test_each_engine_says_whether_it_spans_processes(implementation):
    assert isinstance(getattr(implementation, "ranks"), property)


def test_the_contract_names_what_the_worker_calls():
    """Nothing the worker calls on an engine is outside the contract (`ranks` is a property)."""
    assert {"add_request", "abort", "step", "has_unfinished", "describe", "load", "prepare",
            "num_cached_prompt_tokens", "reserve_remote_prefill", "complete_remote_prefill",
            "cancel_remote_prefill", "release_transfer", "subscribe_events", "wake_on_store_events",
            "flush_store_events", "build_kv_transfer", "attach_kv_store", "close"} == set(CONTRACT_MEMBERS)
    assert {"model", "launch"} <= set(vars(EngineLauncher))
    for launcher in (BuiltinEngineLauncher, VllmEngineLauncher):
        assert callable(launcher.launch) and isinstance(launcher.model, property)


class _Context:
    """What a gRPC servicer method needs of its context, for direct calls."""

    async def abort(self, code, details):
        raise AssertionError(f"the call failed: {code} {details}")


async def _serve_one(engine: FakeEngine):
    service = WorkerService(WorkerOptions("w-fake"), HealthServicer())
    await service.attach(engine, *build_transfer(Role.BOTH, engine))
    try:
        request = worker_pb2.TokenGenerateRequest(request_id="r1", token_ids=[10, 11, 12, 13, 14],
                                                  params=params_to_proto(SamplingParams(max_tokens=4)))
        responses = [r async for r in service.Generate(request, _Context())]
        described = await service.Describe(worker_pb2.DescribeRequest(), _Context())
        stats = await service.Stats(worker_pb2.StatsRequest(), _Context())
        events = [batch async for batch in _first_batch(service)]
        return responses, described, stats, events
    finally:
        await service.close()


async def _first_batch(service: WorkerService):
    async for batch in service.hub.subscribe(0, False):
        yield batch
        return


def test_the_worker_serves_the_stand_in_engine():
    engine = FakeEngine(num_kv_blocks=32)
    responses, described, stats, events = asyncio.run(_serve_one(engine))
    tokens = [t for r in responses for t in r.token_ids]
    assert tokens == [15, 16, 17, 18]                       # the stand-in's rule: previous token + 1
    assert responses[-1].finished
    assert (described.model_name, described.block_size, described.num_kv_blocks) == ("fake", 4, 32)
    assert described.block_hash_extra_key == b"fake"
    assert stats.num_kv_blocks == 32 and stats.num_used_kv_blocks == 0 and stats.num_generated_tokens == 4
    assert [len(e.block_hashes) for e in events[0].events] == [1]     # the prompt's one full block
    assert engine.closed is False                           # the service does not own the engine


def test_a_failing_step_of_any_engine_fails_its_streams_and_the_loop_carries_on():
    engine = FakeEngine()
    loop = EngineLoop(engine)
    loop.start()

    async def main():
        def start(e):
            e.add_request("doomed", [1, 2, 3], SamplingParams(max_tokens=50))
            e.fail_next_step = True
        with pytest.raises(EngineStepError):
            async for _ in loop.stream("doomed", start):
                pass
        add = lambda e: e.add_request("after", [5, 6], SamplingParams(max_tokens=2))  # noqa: E731
        return [out async for out in loop.stream("after", add)]

    try:
        after = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        loop.stop()
    assert [t for o in after for t in o.new_token_ids] == [7, 8] and after[-1].finished
    assert loop.alive is False and not engine.has_unfinished()
