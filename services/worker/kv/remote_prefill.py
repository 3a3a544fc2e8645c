"""The two halves of a disaggregated request on the worker side (DESIGN section 2).

Decode worker (`RemotePrefill`): decide whether the prompt is worth sending
away (conditional disaggregation: the uncached part must reach a threshold),
reserve blocks for it, let the receiver accept writes into the blocks it does
not hold yet, call Prefill on a prefill worker, wait for the transfer's
completion notification (whose payload is the first token), and hand that
token to the engine. When a prefill worker fails (refused, unreachable,
killed, transfer error) the next one is tried, and after the last one the
decode worker prefills locally; everything is bounded by one deadline.

Prefill worker (`serve_prefill`): run the prompt as a prefill-only request
whose per-layer callback is the sender, flush the transfer with the first
token as the notification payload, then release the blocks the engine held
for the transfer.

Every failure path releases the reservation and the receiver's permission,
so a cancelled or failed request leaves no block behind on either worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc
from splitserve.router.hashing import block_hashes
from splitserve.services.engine.engine import LLMEngine, RequestOutput
from splitserve.services.engine.sampler import SampledToken
from splitserve.services.wire.sampling_params import SamplingParams
from splitserve.services.engine.scheduler import Reservation
from splitserve.services.engine.sequence import FinishReason
from splitserve.tls import PLAINTEXT, TlsConfig

from splitserve.services.wire.convert import params_to_proto
from splitserve.services.worker.convert import logprob_to_proto
from splitserve.services.worker.engine_loop import EngineLoop
from splitserve.services.worker.kv.transfer import KVReceiver, KVSender, TransferError, TransferTarget
from splitserve.services.worker.kv.write_fences import WriteFences

log = logging.getLogger(__name__)

GRANT_GRACE_S = 1.0      # a prefill worker gives up this long after the receiver's grant expired

GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 * 2**20),
                ("grpc.max_send_message_length", 64 * 2**20)]


def num_cached_prompt_tokens(engine: LLMEngine, token_ids: list[int]) -> int:
    """Leading prompt tokens this engine's prefix cache holds now (engine thread only)."""
    bs = engine.config.block_size
    hashes = block_hashes(token_ids, bs, engine.scheduler.extra_key)
    return len(engine.pool.cached_prefix(hashes)) * bs


def encode_first_token(token: SampledToken) -> bytes:
    msg = worker_pb2.FirstToken(token_id=token.token_id)
    if token.logprob is not None:
        msg.logprob.CopyFrom(logprob_to_proto(token))
    return msg.SerializeToString()


def decode_first_token(payload: bytes) -> SampledToken:
    msg = worker_pb2.FirstToken.FromString(payload)
    if not msg.HasField("logprob"):
        return SampledToken(msg.token_id)
    return SampledToken(msg.token_id, msg.logprob.logprob, {t.token_id: t.logprob for t in msg.logprob.top})


class PeerChannels:
    """One gRPC channel per prefill worker address, opened on first use."""

    def __init__(self, tls: TlsConfig = PLAINTEXT) -> None:
        self.tls = tls                   # mutual TLS to the other workers (splitserve/tls.py)
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = self.tls.aio_channel(address, options=GRPC_OPTIONS)
            self._channels.append(channel)
            stub = self._stubs[address] = worker_pb2_grpc.WorkerStub(channel)
        return stub

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        self._channels.clear()
        self._stubs.clear()


@dataclass(slots=True)
class PrefillOutcome:
    """How a remote-prefill attempt ended: the first token, or None (prefill locally)."""

    first_token: SampledToken | None
    num_failures: int


@dataclass(slots=True)
class RemotePrefill:
    """Decode side: fills a reservation through prefill workers."""

    loop: EngineLoop
    receiver: KVReceiver
    peers: PeerChannels
    threshold_tokens: int          # minimum uncached prompt tokens worth sending away
    timeout_s: float               # the whole remote prefill, every attempt included
    fences: WriteFences

    async def worth_it(self, token_ids: list[int]) -> bool:
        num_cached = await self.loop.call(lambda e: num_cached_prompt_tokens(e, token_ids))
        uncached = len(token_ids) - num_cached
        return uncached > 0 and uncached >= self.threshold_tokens

    async def run(self, request_id: str, token_ids: list[int], params: SamplingParams,
                  addresses: list[str], on_retry: Callable[[], None]) -> PrefillOutcome:
        """Reserve, then try each prefill worker in turn until one fills the reservation.

        Returns the first token with the reservation still held (complete it next),
        or None with the reservation given back (prefill locally). Cancellation
        gives the reservation back too.
        """
        reservation = await self.loop.call(
            lambda e: e.reserve_remote_prefill(request_id, token_ids, params, fence_writes=True))
        if reservation is None:
            log.info("request %s: no free blocks for a remote prefill; prefilling locally", request_id)
            return PrefillOutcome(None, 0)
        deadline = time.monotonic() + self.timeout_s
        grants_end = deadline + GRANT_GRACE_S       # no sender writes past a grant of this request
        fences: list[asyncio.Task] = []             # FenceTransfer asked of each prefill worker given up
        failures = 0
        try:
            for attempt, address in enumerate(addresses):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if attempt:
                    on_retry()
                try:
                    token = await self._attempt(request_id, token_ids, params, reservation, address, left, fences)
                    return PrefillOutcome(token, failures)
                except (grpc.aio.AioRpcError, TransferError, asyncio.TimeoutError) as exc:
                    failures += 1
                    log.warning("request %s: remote prefill on %s failed (%s); %s", request_id, address,
                                _describe(exc), "trying the next prefill worker"
                                if attempt + 1 < len(addresses) else "prefilling locally")
        except BaseException:
            self._give_up(request_id, fences, grants_end)
            raise
        self._give_up(request_id, fences, grants_end)
        return PrefillOutcome(None, failures)

    def _give_up(self, request_id: str, fences: list[asyncio.Task], grants_end: float) -> None:
        """Cancel the reservation: the engine fences its granted blocks, freed once every
        prefill worker asked confirms it stopped writing (write_fences.py)."""
        self.loop.post(lambda e: e.cancel_remote_prefill(request_id))
        self.fences.release_when_stopped(request_id, fences, grants_end)

    async def _attempt(self, request_id: str, token_ids: list[int], params: SamplingParams,
                       reservation: Reservation, address: str, timeout_s: float,
                       fences: list[asyncio.Task]) -> SampledToken:
        bs = self.loop.engine.config.block_size
        num_cached_blocks = reservation.num_cached_tokens // bs
        try:
            grant = self.receiver.expect(request_id, reservation.block_ids[num_cached_blocks:], timeout_s)
            ep = self.receiver.endpoint()
            target = worker_pb2.TransferTarget(
                agent_name=ep.agent_name, agent_metadata=ep.agent_metadata, layout_hash=ep.layout_hash,
                block_ids=reservation.block_ids, num_cached_blocks=num_cached_blocks,
                incarnation=grant.incarnation, deadline_unix=grant.deadline_unix,
                other_ranks=[worker_pb2.TransferAgent(agent_name=r.agent_name, agent_metadata=r.agent_metadata,
                                                      incarnation=r.incarnation) for r in ep.other_ranks])
            request = worker_pb2.PrefillRequest(request_id=request_id, token_ids=token_ids,
                                                params=params_to_proto(params), target=target)
            async with asyncio.timeout(timeout_s):
                await self.peers.stub(address).Prefill(request)
                payload = await self.receiver.wait_complete(request_id)
            return decode_first_token(payload)
        except BaseException:           # failed or cancelled: the worker may still be writing
            fences.append(self.fences.ask(address, request_id))
            raise
        finally:
            self.receiver.release(request_id)

    def complete(self, request_id: str, first_token: SampledToken):
        """The `start` function for EngineLoop.stream: join the batch from the first token."""
        def start(engine: LLMEngine) -> list[RequestOutput]:
            out = engine.complete_remote_prefill(request_id, first_token)
            if out is None:
                engine.release_fence(request_id)    # aborted meanwhile; every write has landed
                raise TransferError(f"request {request_id!r} lost its reservation (aborted?)")
            return [out]
        return start


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, asyncio.TimeoutError):
        return "deadline exceeded"
    return str(exc) or type(exc).__name__


async def serve_prefill(loop: EngineLoop, sender: KVSender, request_id: str, token_ids: list[int],
                        params: SamplingParams, target: TransferTarget) -> RequestOutput:
    """Prefill side: compute the prompt, pushing each layer; returns the first-token output.

    The engine holds the request's blocks after the prefill (the writes read them);
    they are released once the transfer is over, whatever its outcome. The work is
    bounded by the receiver's grant: past its deadline the receiver refuses the writes
    anyway, so a receiver that vanished without closing the connection cannot keep
    this worker's blocks held.
    """
    sender.begin(request_id, target, len(token_ids))
    grant = target.grant
    left = grant.deadline_unix - time.time() + GRANT_GRACE_S if grant is not None and grant.deadline_unix > 0 else None
    try:
        async with asyncio.timeout(left):
            last = None
            start = lambda e: e.add_request(request_id, token_ids, params, prefill_only=True,  # noqa: E731
                                            on_layer_done=sender.on_layer_ready)
            async for out in loop.stream(request_id, start):
                last = out
            if last is None or last.finish_reason is not FinishReason.PREFILL_DONE:
                raise TransferError(f"prefill of {request_id!r} ended without a first token")
            token = last.logprobs[0] if last.logprobs else SampledToken(last.new_token_ids[0])
            await sender.finish(request_id, encode_first_token(token))
        return last
    except TimeoutError:
        sender.abandon(request_id)
        raise TransferError(f"prefill of {request_id!r}: the receiver's grant expired before the "
                            "transfer completed") from None
    except BaseException:
        sender.abandon(request_id)
        raise
    finally:
        loop.post(lambda e: e.release_prefill(request_id))
