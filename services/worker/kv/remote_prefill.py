"""Decode side of a disaggregated request: have a prefill worker fill the prompt's KV (DESIGN section 2).

`RemotePrefill` decides whether the prompt is worth sending away (conditional
disaggregation: the uncached part must reach a threshold), reserves blocks for
it (waiting while the pool is short, rather than stall the running decodes with a
local prefill), lets the receiver accept writes into the blocks it does not hold yet, calls
Prefill on a prefill worker, waits for the transfer's completion notification
(whose payload is the first token), and hands that token to the engine. When a
prefill worker fails (refused, unreachable, killed, transfer error) the next one
is tried, and after the last one the decode worker prefills locally; everything
is bounded by one deadline.

Every failure path releases the receiver's permission and gives the reservation
back. Its granted blocks stay owned by the transfer (scheduler.transfer_owned)
until `WriteFences` (write_fences.py) knows no write into them can land, so a
cancelled or failed request leaves no block behind once its fence is released.
The prefill half is prefill_server.py.

Several samples of one prompt (n > 1) send one Prefill: the prefill worker computes the
prompt once and samples the first request's first token, as for n = 1. The other samples
fork on this (decode) worker once the KV has arrived (engine.complete_remote_prefill):
they share the received blocks and each recomputes only the last prompt token, into its
own copy of that token's block, for its own logits. Sampling all n first tokens on the
prefill worker instead would need n parameter sets and n tokens in the Prefill call and in
the transfer's completion payload (and its seeded draws skipped per sample here); one
recomputed token per sample costs less than that protocol and keeps it unchanged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc
from splitserve.services.engine_api.contract import Engine, Reservation
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.tls import PLAINTEXT, TlsConfig
from splitserve.tracing import GenAI, Tracer

from splitserve.services.worker_protocol.proto_conversion import params_to_proto
from splitserve.services.worker.output_messages import MIGRATED_KV, decode_first_token, logprob_from_proto
from splitserve.services.worker.engine_loop import EngineLoop
from splitserve.kvtransfer.sender_receiver import GRANT_GRACE_S, KVReceiver, TransferError
from splitserve.services.worker.kv.write_fences import WriteFences
from splitserve.services.worker_protocol.outputs import RequestOutput, SampledToken

log = logging.getLogger(__name__)

T = TypeVar("T")

RESERVE_RETRY_S = (0.02, 0.25)      # first and longest pause between reservation attempts
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 * 2**20),
                ("grpc.max_send_message_length", 64 * 2**20)]


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
    prompt_logprobs: list[SampledToken] | None = None   # the prefill worker's, when params asked


@dataclass(slots=True)
class RemotePrefill:
    """Decode side: fills a reservation through prefill workers."""

    loop: EngineLoop
    receiver: KVReceiver
    peers: PeerChannels
    threshold_tokens: int          # minimum uncached prompt tokens worth sending away
    timeout_s: float               # the whole remote prefill, every attempt included
    fences: WriteFences            # its clock times the deadline too (the fences' expiry)
    tracer: Tracer | None = None   # None: tracing is off; else `queue` and `remote_prefill` spans

    async def worth_it(self, token_ids: list[int], cache_salt: str = "") -> bool:
        num_cached = await self.loop.call(lambda e: e.num_cached_prompt_tokens(token_ids, cache_salt))
        uncached = len(token_ids) - num_cached
        return uncached > 0 and uncached >= self.threshold_tokens

    async def run(self, request_id: str, token_ids: list[int], params: SamplingParams,
                  addresses: list[str], on_retry: Callable[[], None],
                  forks: list[tuple[str, SamplingParams]] = (), span=None) -> PrefillOutcome:
        """Reserve, then try each prefill worker in turn until one fills the reservation.
        `forks`: the request's other samples (n > 1), forked here once the KV arrived. `span`:
        the request's span (request_tracing.py), parent of the queue and each attempt's.

        Returns the first token with the reservation still held (complete it next),
        or None with the reservation given back (prefill locally). Cancellation
        gives the reservation back too.
        """
        clock = self.fences.clock
        deadline = clock() + self.timeout_s
        queue = None if self.tracer is None else self.tracer.start_span("queue", span, attributes={
            "splitserve.queue.waiting_for": "kv_blocks"})
        reservation = None
        try:
            reservation = await self._reserve(request_id, token_ids, params, forks, deadline)
        finally:
            if queue is not None:
                queue.set_attribute("splitserve.queue.reserved", reservation is not None)
                if span is not None:          # vLLM's name for the time a request waited to run
                    span.set_attribute(GenAI.LATENCY_TIME_IN_QUEUE, clock() + self.timeout_s - deadline)
                queue.end()
        if reservation is None:
            log.info("request %s: no free blocks for a remote prefill within %.0f s; prefilling locally",
                     request_id, self.timeout_s)
            return PrefillOutcome(None, 0)
        grants_end = deadline + GRANT_GRACE_S       # no sender writes past a grant of this request
        fences: list[asyncio.Task] = []             # FenceTransfer asked of each prefill worker given up

        async def attempt(address: str, left: float, index: int):
            return await self._attempt(request_id, token_ids, params, reservation, address, left, fences, span, index)
        try:
            result, failures = await try_prefill_workers(request_id, addresses, deadline, clock, on_retry, attempt,
                                                         (grpc.aio.AioRpcError, TransferError, asyncio.TimeoutError))
        except BaseException:
            self._give_up(request_id, fences, grants_end)
            raise
        if result is not None:
            token, prompt_logprobs = result
            return PrefillOutcome(token, failures, prompt_logprobs)
        self._give_up(request_id, fences, grants_end)
        return PrefillOutcome(None, failures)

    async def migrate(self, request_id: str, token_ids: list[int], params: SamplingParams,
                      source: worker_pb2.KvSource, span=None) -> bool:
        """A live migration: reserve blocks for `token_ids` (prompt + output so far) and have the
        decode worker at `source` send the KV of all but the last token from its suspended
        request (PrefillRequest.migrate_request_id). True: the reservation holds it (start with
        `complete_migration`); False: it was given back (the caller prefills as without it)."""
        clock = self.fences.clock
        deadline = clock() + self.timeout_s
        reserve = lambda e: e.reserve_migration(request_id, token_ids, params)  # noqa: E731
        reservation = await self._reserve_with(reserve, deadline)
        if reservation is None:
            log.info("request %s: no free blocks for a migrated request's KV; recomputing it", request_id)
            return False
        fences: list[asyncio.Task] = []
        bs = self.loop.engine.describe().block_size
        num_blocks = -(-(len(token_ids) - 1) // bs)          # the KV sent: all tokens but the last
        try:
            if reservation.num_cached_tokens // bs < num_blocks:
                await self._attempt(request_id, token_ids, params, reservation, source.address,
                                    deadline - clock(), fences, span, migrate=(source.request_id, num_blocks))
            return True
        except (grpc.aio.AioRpcError, TransferError, asyncio.TimeoutError) as exc:
            log.warning("request %s: the KV of %s on %s could not be moved (%s); recomputing it", request_id,
                        source.request_id, source.worker_id or source.address, describe_failure(exc))
        except BaseException:
            self._give_up(request_id, fences, deadline + GRANT_GRACE_S)
            raise
        self._give_up(request_id, fences, deadline + GRANT_GRACE_S)
        return False

    def complete_migration(self, request_id: str):
        """The `start` function for EngineLoop.stream after `migrate`: compute the last token."""
        def start(engine: Engine) -> list[RequestOutput]:
            if engine.complete_migration(request_id) is None:
                engine.release_transfer(request_id)
                raise TransferError(f"request {request_id!r} lost its reservation (aborted?)")
            return []
        return start

    async def _reserve(self, request_id: str, token_ids: list[int], params: SamplingParams,
                       forks: list[tuple[str, SamplingParams]], deadline: float) -> Reservation | None:
        return await self._reserve_with(
            lambda e: e.reserve_remote_prefill(request_id, token_ids, params, fence_writes=True, forks=forks),
            deadline)

    async def _reserve_with(self, reserve: Callable[[Engine], Reservation | None], deadline: float
                            ) -> Reservation | None:
        """Blocks for the prompt, waiting while the pool is short (running decodes free theirs as
        they finish). Prefilling locally at once instead would stall every running decode for
        the whole prompt, which is what the prefill pool is there to spare them."""
        pause = RESERVE_RETRY_S[0]
        while True:
            reservation = await self.loop.call(reserve)
            if reservation is not None or self.fences.clock() + pause >= deadline:
                return reservation
            await self.fences.sleep(pause)
            pause = min(2 * pause, RESERVE_RETRY_S[1])

    def _give_up(self, request_id: str, fences: list[asyncio.Task], grants_end: float) -> None:
        """Cancel the reservation: its granted blocks stay owned by the transfer, freed once
        every prefill worker asked confirms it stopped writing (write_fences.py)."""
        self.loop.post(lambda e: e.cancel_remote_prefill(request_id))
        self.fences.release_when_stopped(request_id, fences, grants_end)

    async def _attempt(self, request_id: str, token_ids: list[int], params: SamplingParams,
                       reservation: Reservation, address: str, timeout_s: float,
                       fences: list[asyncio.Task], span=None, attempt: int = 0,
                       migrate: tuple[str, int] | None = None) -> tuple[SampledToken, list[SampledToken] | None]:
        """`migrate`: (the source's suspended request, blocks it sends): a live migration's
        transfer, whose completion carries no first token."""
        bs = self.loop.engine.describe().block_size
        num_cached_blocks = reservation.num_cached_tokens // bs
        granted = reservation.block_ids if migrate is None else reservation.block_ids[:migrate[1]]
        call = None if self.tracer is None else self.tracer.start_span("remote_prefill", span, "client", {
            "splitserve.prefill_worker.address": address, "splitserve.prefill.attempt": attempt,
            "splitserve.kv_transfer.num_blocks": len(reservation.block_ids) - num_cached_blocks,
            "splitserve.kv_transfer.num_cached_blocks": num_cached_blocks})
        try:
            grant = self.receiver.expect(request_id, granted[num_cached_blocks:], timeout_s)
            ep = self.receiver.endpoint()
            target = worker_pb2.TransferTarget(
                agent_name=ep.agent_name, agent_metadata=ep.agent_metadata, layout_hash=ep.layout_hash,
                block_ids=granted, num_cached_blocks=num_cached_blocks,
                incarnation=grant.incarnation, deadline_unix=grant.deadline_unix,
                other_ranks=[worker_pb2.TransferAgent(agent_name=r.agent_name, agent_metadata=r.agent_metadata,
                                                      incarnation=r.incarnation) for r in ep.other_ranks])
            request = worker_pb2.PrefillRequest(request_id=request_id, token_ids=token_ids,
                                                params=params_to_proto(params), target=target,
                                                cache_salt=params.cache_salt,
                                                migrate_request_id=migrate[0] if migrate else "")
            send_trace_context(self.tracer, call, request)
            async with asyncio.timeout(timeout_s):
                response = await self.peers.stub(address).Prefill(request)
                payload = await self.receiver.wait_complete(request_id)
            if call is not None:
                call.set_attribute("splitserve.prefill_worker.num_cached_tokens", response.num_cached_tokens)
            if migrate is not None:
                if payload != MIGRATED_KV:
                    raise TransferError(f"request {request_id!r}: the migration's source answered another payload")
                return SampledToken(-1), None
            return decode_first_token(payload), prompt_logprobs_of(params, response)
        except BaseException as exc:    # failed or cancelled: the worker may still be writing
            fences.append(self.fences.ask(address, request_id))
            if call is not None:
                self.tracer.fail(call, describe_failure(exc))
            raise
        finally:
            self.receiver.release(request_id)
            if call is not None:
                call.end()

    def complete(self, request_id: str, first_token: SampledToken,
                 prompt_logprobs: list[SampledToken] | None = None):
        """The `start` function for EngineLoop.stream: join the batch from the first token (and
        the prompt logprobs the prefill worker computed, sent on with it)."""
        def start(engine: Engine) -> list[RequestOutput]:
            out = engine.complete_remote_prefill(request_id, first_token, prompt_logprobs)
            if out is None:
                engine.release_transfer(request_id)    # aborted meanwhile; every write has landed
                raise TransferError(f"request {request_id!r} lost its reservation (aborted?)")
            return [out] if out.new_token_ids or out.finished else []   # vLLM samples the first token itself
        return start


async def try_prefill_workers(request_id: str, addresses: list[str], deadline: float, clock: Callable[[], float],
                              on_retry: Callable[[], None], attempt: Callable[[str, float, int], Awaitable[T]],
                              errors: tuple[type[BaseException], ...]) -> tuple[T | None, int]:
    """Each prefill worker of `addresses` in turn, all within one deadline (on `clock`):
    `attempt(address, seconds_left, index)`'s result from the first that succeeds, or None once
    every one failed with one of `errors` or the deadline passed; with the number of failures.
    Used by splitserve's own flow (RemotePrefill) and by the engines' handoff (handoff.py)."""
    failures = 0
    for index, address in enumerate(addresses):
        left = deadline - clock()
        if left <= 0:
            break
        if index:
            on_retry()
        try:
            return await attempt(address, left, index), failures
        except errors as exc:
            failures += 1
            log.warning("request %s: remote prefill on %s failed (%s); %s", request_id, address,
                        describe_failure(exc), "trying the next prefill worker"
                        if index + 1 < len(addresses) else "prefilling locally")
    return None, failures


def send_trace_context(tracer: Tracer | None, call, request: worker_pb2.PrefillRequest) -> None:
    """Put the `remote_prefill` span `call`'s context in the Prefill request (the prefill worker's
    spans continue it); nothing when tracing is off."""
    if call is not None:
        context = tracer.context_of(call)
        request.trace_context.traceparent, request.trace_context.tracestate = context.traceparent, context.tracestate


def prompt_logprobs_of(params: SamplingParams, response: worker_pb2.PrefillResponse) -> list[SampledToken] | None:
    """The prompt logprobs a prefill worker answered, when the request asked for them."""
    if params.prompt_logprobs is None:
        return None
    return [logprob_from_proto(t) for t in response.prompt_logprobs]


def describe_failure(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, asyncio.TimeoutError):
        return "deadline exceeded"
    return str(exc) or type(exc).__name__

