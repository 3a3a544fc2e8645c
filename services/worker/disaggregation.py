"""The two halves of a disaggregated request on the worker side (DESIGN section 2).

Decode worker (`RemotePrefill`): decide whether the prompt is worth sending
away (conditional disaggregation: the uncached part must reach a threshold),
reserve blocks for it, let the receiver accept writes into them, call Prefill
on the chosen prefill worker, wait for the transfer's completion, and hand the
first token to the engine. Prefill worker (`serve_prefill`): run the prompt as
a prefill-only request whose per-layer callback is the sender, then flush.

Every failure path releases the reservation and the receiver's permission,
so a cancelled or failed request leaves no block behind on either worker.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from splitserve.errors import InvalidRequestError
from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc
from splitserve.services.engine.block_hash import hash_full_blocks
from splitserve.services.engine.engine import LLMEngine, RequestOutput
from splitserve.services.engine.sampling_params import SamplingParams
from splitserve.services.engine.scheduler import Reservation
from splitserve.services.engine.sequence import FinishReason

from .convert import params_to_proto
from .engine_loop import EngineLoop
from .transfer import KVReceiver, KVSender, TransferError, TransferTarget

log = logging.getLogger(__name__)


def num_cached_prompt_tokens(engine: LLMEngine, token_ids: list[int]) -> int:
    """Leading prompt tokens this engine's prefix cache holds now (engine thread only)."""
    bs = engine.config.block_size
    hashes = hash_full_blocks(token_ids, bs, engine.scheduler.extra_key)
    return len(engine.pool.cached_prefix(hashes)) * bs


class PeerChannels:
    """One gRPC channel per prefill worker address, opened on first use."""

    def __init__(self) -> None:
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address)
            self._channels.append(channel)
            stub = self._stubs[address] = worker_pb2_grpc.WorkerStub(channel)
        return stub

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        self._channels.clear()
        self._stubs.clear()


@dataclass(slots=True)
class RemotePrefill:
    """Decode side: fills a reservation through a prefill worker."""

    loop: EngineLoop
    receiver: KVReceiver
    peers: PeerChannels
    threshold_tokens: int          # minimum uncached prompt tokens worth sending away
    timeout_s: float

    async def worth_it(self, token_ids: list[int]) -> bool:
        num_cached = await self.loop.call(lambda e: num_cached_prompt_tokens(e, token_ids))
        return len(token_ids) - num_cached >= self.threshold_tokens

    async def reserve(self, request_id: str, token_ids: list[int], params: SamplingParams
                      ) -> Reservation | None:
        """Blocks for the whole prompt; None when the pool is full (prefill locally then)."""
        return await self.loop.call(lambda e: e.reserve_remote_prefill(request_id, token_ids, params))

    async def fill(self, request_id: str, token_ids: list[int], params: SamplingParams,
                   reservation: Reservation, address: str) -> int:
        """Have the prefill worker at `address` fill `reservation`; returns the first token.

        On any failure or cancellation the reservation is dropped before this raises.
        """
        try:
            self.receiver.expect(request_id, reservation.block_ids)
            endpoint = self.receiver.endpoint()
            target = worker_pb2.TransferTarget(
                agent_name=endpoint.agent_name, agent_metadata=endpoint.agent_metadata,
                layout_hash=endpoint.layout_hash, block_ids=reservation.block_ids,
                num_cached_blocks=reservation.num_cached_tokens // self.loop.engine.config.block_size)
            request = worker_pb2.PrefillRequest(request_id=request_id, token_ids=token_ids,
                                                params=params_to_proto(params), target=target)
            response = await self.peers.stub(address).Prefill(request, timeout=self.timeout_s)
            await asyncio.wait_for(self.receiver.wait_complete(request_id), self.timeout_s)
            return response.first_token_id
        except BaseException:
            self.loop.abort(request_id)
            raise
        finally:
            self.receiver.release(request_id)

    def complete(self, request_id: str, first_token_id: int):
        """The `start` function for EngineLoop.stream: join the batch from the first token."""
        def start(engine: LLMEngine) -> list[RequestOutput]:
            out = engine.complete_remote_prefill(request_id, first_token_id)
            if out is None:
                raise InvalidRequestError(f"request {request_id!r} has no reservation (aborted?)")
            return [out]
        return start


async def serve_prefill(loop: EngineLoop, sender: KVSender, request_id: str, token_ids: list[int],
                        params: SamplingParams, target: TransferTarget) -> RequestOutput:
    """Prefill side: compute the prompt, pushing each layer; returns the first-token output."""
    sender.begin(request_id, target)
    try:
        last = None
        start = lambda e: e.add_request(request_id, token_ids, params, prefill_only=True,  # noqa: E731
                                        on_layer_done=sender.on_layer_ready)
        async for out in loop.stream(request_id, start):
            last = out
        if last is None or last.finish_reason is not FinishReason.PREFILL_DONE:
            raise TransferError(f"prefill of {request_id!r} ended without a first token")
        await sender.finish(request_id)
        return last
    except BaseException:
        sender.abandon(request_id)
        raise
