"""The gRPC Worker service over one EngineLoop (proto/splitserve/v1/worker.proto).

Every call is isolated: an error in one request becomes that call's gRPC
status (INVALID_ARGUMENT for bad input, with the engine's message) and the
worker carries on. A call the client cancels aborts its engine request, so
its blocks are free by the next step. Until the model is loaded, and after
Drain, calls that would start work get UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import uuid
from dataclasses import dataclass, replace

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from splitserve.errors import FatalError, InvalidRequestError, RecoverableError
from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc
from splitserve.services.engine_api.contract import Engine, EngineLoad, KVMigrationEngine
from splitserve.tls import PLAINTEXT, TlsConfig
from splitserve.tracing import Tracer

from splitserve.services.worker_protocol.proto_conversion import params_from_proto
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.services.worker.output_messages import event_to_proto, logprob_to_proto, output_to_proto
from splitserve.services.worker.engine_loop import EngineLoop, EngineStoppedError
from splitserve.services.worker.kv.handoff import HandoffPrefill, serve_handoff_prefill
from splitserve.services.worker.kv.migration_source import SuspendedRequests
from splitserve.services.worker.kv.prefill_server import serve_prefill
from splitserve.services.worker.kv.remote_prefill import PeerChannels, RemotePrefill
from splitserve.kvtransfer.sender_receiver import (KVReceiver, KVSender, TransferEndpoint, TransferError,
                                                   TransferGrant, TransferNotWiredError, TransferTarget)
from splitserve.services.worker.kv.write_fences import WriteFences
from splitserve.services.worker.kv_event_hub import KvEventHub
from splitserve.services.worker.session import GenerateSession
from splitserve.services.worker.request_tracing import GenerateTrace, prefill_span

log = logging.getLogger(__name__)

SERVICE_NAME = "splitserve.v1.Worker"
FENCE_DRAIN_TIMEOUT_S = 1.5     # a prefill worker's wait for its posted writes (under WriteFences' ask)


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    def to_proto(self) -> int:
        return {Role.PREFILL: worker_pb2.WORKER_ROLE_PREFILL, Role.DECODE: worker_pb2.WORKER_ROLE_DECODE,
                Role.BOTH: worker_pb2.WORKER_ROLE_BOTH}[self]


class WorkerUnavailableError(RecoverableError):
    """Not loaded yet, draining, or shutting down: try another worker."""


@dataclass(slots=True)
class WorkerOptions:
    worker_id: str
    role: Role = Role.BOTH
    remote_prefill_threshold: int = 64     # uncached prompt tokens below this prefill locally
    prefill_timeout_s: float = 30.0        # a remote prefill, retries included; then prefill locally
    kv_event_buffer: int = 10_000
    tls: TlsConfig = PLAINTEXT             # this worker's certificate and CA (mutual TLS; splitserve/tls.py)
    otlp_traces_endpoint: str | None = None   # export traces there (splitserve/tracing.py); None: off


@dataclass(slots=True)
class WorkerCounters:
    num_requests: int = 0
    num_local_prefills: int = 0
    num_remote_prefills: int = 0
    num_prefills_served: int = 0
    num_prefill_retries: int = 0
    num_prefill_fallbacks: int = 0
    num_fences_served: int = 0
    num_suspended: int = 0                 # live migrations: requests suspended here for another worker
    num_kv_migrations_sent: int = 0        # ... whose KV was sent from here
    num_kv_migrations_received: int = 0    # requests that arrived with their KV from another worker
    num_kv_migration_fallbacks: int = 0    # ... whose KV could not be moved (recomputed here)
    num_errors: int = 0
    num_in_flight: int = 0


def fork_id(request_id: str, choice: int) -> str:
    """The engine id of sample `choice` of a request with n > 1."""
    return f"{request_id}/{choice}"


def choice_params(params, choice: int):
    """Sample `choice`'s parameters: seed + choice when seeded (so n seeded samples differ and
    each is reproducible, as the frontend's separate requests were)."""
    return replace(params, seed=params.seed + choice if params.seed is not None else None)


def _status_of(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, TransferNotWiredError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, (WorkerUnavailableError, TransferError, EngineStoppedError)):
        return grpc.StatusCode.UNAVAILABLE     # this worker cannot serve it now: try another
    if isinstance(exc, RecoverableError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


async def compile_grammar(loop: EngineLoop, params: SamplingParams) -> None:
    """A structured request's grammar, compiled (or found in the cache) on a thread before the
    request is queued, so that compiling never holds up the engine's steps."""
    if params.structured is not None:
        await asyncio.to_thread(loop.engine.prepare, params)


def _transfer_target(t: worker_pb2.TransferTarget) -> TransferTarget:
    other_ranks = tuple(TransferEndpoint(r.agent_name, r.agent_metadata, t.layout_hash, r.incarnation)
                        for r in t.other_ranks)      # a TP decode worker's ranks 1..M-1
    return TransferTarget(TransferEndpoint(t.agent_name, t.agent_metadata, t.layout_hash, t.incarnation, other_ranks),
                          list(t.block_ids), t.num_cached_blocks, TransferGrant(t.incarnation, t.deadline_unix))


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self, options: WorkerOptions, health: HealthServicer, tracer: Tracer | None = None):
        self.options = options
        self.health = health
        self.tracer = tracer                   # None: tracing is off
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self.instance_id = uuid.uuid4().hex
        self.counters = WorkerCounters()
        self.draining = False
        self.peers = PeerChannels(options.tls)
        self.loop: EngineLoop | None = None
        self.hub = KvEventHub(options.kv_event_buffer)
        self.remote: RemotePrefill | None = None
        self.handoff: HandoffPrefill | None = None     # the engine's own connector moves the KV
        self.fences: WriteFences | None = None
        self.suspended: SuspendedRequests | None = None   # live migration's source side
        self._background: set[asyncio.Task] = set()
        self.sessions: set[GenerateSession] = set()   # gRPC calls and session streams
        self.session_port = 0                  # the session stream's, once it listens (server.py)

    # -- lifecycle ---------------------------------------------------------------
    async def attach(self, engine: Engine, sender: KVSender, receiver: KVReceiver) -> None:
        """The model is loaded (and its KV pool registered with the transfer): start the
        engine loop and report SERVING."""
        self.sender, self.receiver = sender, receiver
        engine.subscribe_events(self.hub.publish)
        self.loop = EngineLoop(engine)
        self.loop.start()
        self.fences = WriteFences(self.loop, self.peers)
        self.suspended = SuspendedRequests(self.loop)
        self.remote = RemotePrefill(self.loop, self.receiver, self.peers,
                                    self.options.remote_prefill_threshold, self.options.prefill_timeout_s,
                                    self.fences, self.tracer)
        if engine.describe().kv_handoff:
            self.handoff = HandoffPrefill(self.peers, self.options.prefill_timeout_s, self.tracer)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    async def close(self) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.fences is not None:
            await self.fences.close()
        if self.loop is not None:
            self.loop.stop()
        await self.peers.close()
        for transfer in {id(t): t for t in (self.sender, self.receiver) if t is not None}.values():
            transfer.close()

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def _engine_loop(self, admit: bool = True) -> EngineLoop:
        if self.loop is None or not self.loop.alive:
            raise WorkerUnavailableError(f"worker {self.options.worker_id} is not ready")
        if admit and self.draining:
            raise WorkerUnavailableError(f"worker {self.options.worker_id} is draining")
        return self.loop

    async def _fail(self, context: grpc.aio.ServicerContext, method: str, request_id: str,
                    exc: BaseException) -> None:
        await context.abort(self.failure_status(method, request_id, exc), str(exc) or type(exc).__name__)

    def failure_status(self, method: str, request_id: str, exc: BaseException) -> grpc.StatusCode:
        """Count and log a call's failure; the status it ends with."""
        self.counters.num_errors += 1
        code = _status_of(exc)
        if code is grpc.StatusCode.INTERNAL:
            log.error("worker %s: %s %s failed: %r", self.options.worker_id, method, request_id, exc,
                      exc_info=not isinstance(exc, FatalError))
        else:
            log.info("worker %s: %s %s refused: %s", self.options.worker_id, method, request_id, exc)
        return code

    # -- Generate ----------------------------------------------------------------
    async def Generate(self, request, context):
        request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
        failure = None
        try:
            async for response in self.generate(request_id, request):
                yield response
        except Exception as exc:
            failure = exc
        if failure is not None:
            await self._fail(context, "Generate", request_id, failure)

    async def GenerateSession(self, request_iterator, context):
        session = GenerateSession(self)
        self.sessions.add(session)
        try:
            async for response in session.run(request_iterator):
                yield response
        finally:
            self.sessions.discard(session)

    def end_sessions(self) -> None:
        """Let every GenerateSession call end once its running requests are done (see session.py)."""
        for session in self.sessions:
            session.end()

    async def generate(self, request_id: str, request: worker_pb2.TokenGenerateRequest):
        """One Generate request's messages (Generate and GenerateSession); raises what refuses it."""
        self.counters.num_in_flight += 1
        try:
            loop = self._engine_loop()
            params = params_from_proto(request.params, request.cache_salt)
            await compile_grammar(loop, params)
            token_ids = list(request.token_ids)
            self.counters.num_requests += 1
            kv_source = request.kv_source if request.HasField("kv_source") else None
            peers = [request.prefill_peer.address] if request.HasField("prefill_peer") else []
            peers += [p.address for p in request.alternate_prefill_peers if p.address not in peers]
            trace = None if self.tracer is None else \
                GenerateTrace(self.tracer, self.options.worker_id, request_id, request, params)
            error = None
            try:
                async for response in self._generate(loop, request_id, token_ids, params, peers,
                                                     max(1, request.n), trace, kv_source):
                    yield response
            except BaseException as exc:
                error = None if isinstance(exc, GeneratorExit) else exc    # closed by the caller: not a failure
                raise
            finally:
                if trace is not None:
                    trace.end(error)
        finally:
            self.counters.num_in_flight -= 1

    def _disaggregates(self) -> bool:
        return self.options.role is Role.DECODE and self.receiver is not None and bool(self.receiver.backend)

    def _moves_kv(self) -> str:
        """Why this worker cannot take part in a live migration that moves the KV; "" when it can."""
        if not self._disaggregates():
            return (f"worker {self.options.worker_id} is not a decode worker with a KV transfer "
                    f"(role {self.options.role.value}): its requests are migrated by token replay")
        if self.handoff is not None or not isinstance(self.loop.engine, KVMigrationEngine):
            return (f"worker {self.options.worker_id}'s engine does not move a running request's KV: "
                    "its requests are migrated by token replay")
        if self.loop.engine.describe().tensor_parallel_size > 1:
            return (f"worker {self.options.worker_id} is tensor parallel (each rank would send its share; "
                    "not built yet): its requests are migrated by token replay")
        return ""

    async def _generate(self, loop: EngineLoop, request_id: str, token_ids: list[int], params,
                        peers: list[str], n: int = 1, trace: GenerateTrace | None = None,
                        kv_source: worker_pb2.KvSource | None = None):
        """One request's messages; n > 1 samples of the prompt run as engine forks (one prefill,
        shared KV blocks) with engine ids "<request_id>/<i>", each message tagged with i.
        `kv_source`: a live migration's, whose KV is read from there (else recomputed here)."""
        ids = [request_id] if n == 1 else [fork_id(request_id, i) for i in range(n)]
        forks = [(ids[i], choice_params(params, i)) for i in range(1, n)]
        choice = {rid: i for i, rid in enumerate(ids)}
        remote = self.remote
        if kv_source is not None:
            span = trace.span if trace is not None else None
            if n == 1 and not self._moves_kv() and await remote.migrate(request_id, token_ids, params, kv_source, span):
                self.counters.num_kv_migrations_received += 1
                async for response in self._stream(loop, ids, remote.complete_migration(request_id), choice, trace,
                                                   kv_moved=True):
                    yield response
                return
            self.counters.num_kv_migration_fallbacks += 1
            self._release_source(kv_source)
        if peers and self._disaggregates() and await remote.worth_it(token_ids, params.cache_salt):
            span = trace.span if trace is not None else None
            if self.handoff is not None:
                outcome = await self.handoff.run(ids[0], token_ids, params, peers, self._count_retry, span)
                start = None if outcome.kv_handoff is None else lambda e: e.add_handed_off(  # noqa: E731
                    ids[0], token_ids, params, outcome.kv_handoff, forks=forks, prompt_logprobs=outcome.prompt_logprobs)
            else:
                outcome = await remote.run(ids[0], token_ids, params, peers, self._count_retry, forks, span)
                start = None if outcome.first_token is None else \
                    remote.complete(ids[0], outcome.first_token, outcome.prompt_logprobs)
            if start is not None:
                self.counters.num_remote_prefills += 1
                if trace is not None:
                    trace.prefilled_remotely()
                async for response in self._stream(loop, ids, start, choice, trace, prefilled_remotely=True):
                    yield response
                return
            if outcome.num_failures:
                self.counters.num_prefill_fallbacks += 1
        self.counters.num_local_prefills += 1
        if trace is not None:
            trace.prefilling_locally()
        add = lambda e: e.add_request(ids[0], token_ids, params, forks=forks)  # noqa: E731
        async for response in self._stream(loop, ids, add, choice, trace):
            yield response

    @staticmethod
    async def _stream(loop: EngineLoop, ids: list[str], start, choice: dict[str, int],
                      trace: GenerateTrace | None, prefilled_remotely: bool = False, kv_moved: bool = False):
        async for out in loop.stream(ids[0], start, ids[1:]):
            if trace is not None:
                trace.observe(out)
            yield output_to_proto(out, prefilled_remotely=prefilled_remotely, choice=choice[out.request_id],
                                  kv_moved=kv_moved)

    def abort_choice(self, request_id: str, running: set[str] | dict) -> bool:
        """A session's abort of one sample "<request_id>/<i>" of a running request of `running`;
        False when `request_id` names no such sample."""
        parent, sep, index = request_id.rpartition("/")
        if not sep or parent not in running or not index.isdigit() or self.loop is None:
            return False
        self.loop.abort(request_id)
        return True

    def _count_retry(self) -> None:
        self.counters.num_prefill_retries += 1

    # -- Prefill -----------------------------------------------------------------
    async def Prefill(self, request, context):
        failure = span = None
        self.counters.num_in_flight += 1
        try:
            if request.migrate_request_id:
                return await self._send_suspended(request)
            loop = self._engine_loop()
            if not request.request_id:
                raise InvalidRequestError("Prefill needs a request_id")
            params = params_from_proto(request.params, request.cache_salt)
            await compile_grammar(loop, params)
            if self.tracer is not None:
                span = prefill_span(self.tracer, self.options.worker_id, request, params)
            if request.kv_handoff:
                if not loop.engine.describe().kv_handoff:
                    raise InvalidRequestError(f"worker {self.options.worker_id}'s engine does not hand KV off "
                                              "(it pushes it through splitserve's KV transfer): the decode worker "
                                              "and this prefill worker must run the same --kv-connector")
                out = await serve_handoff_prefill(loop, request.request_id, list(request.token_ids), params)
            else:
                out = await serve_prefill(loop, self.sender, request.request_id, list(request.token_ids),
                                          params, _transfer_target(request.target), self.tracer, span)
            self.counters.num_prefills_served += 1
            response = worker_pb2.PrefillResponse(
                first_token_id=out.new_token_ids[0], num_prompt_tokens=out.num_prompt_tokens,
                num_cached_tokens=out.num_cached_tokens,
                prompt_logprobs=[logprob_to_proto(t) for t in out.prompt_logprobs or []],
                kv_transfer_params_json=json.dumps(out.kv_handoff) if out.kv_handoff else "")
            if out.logprobs:
                response.first_logprob.CopyFrom(logprob_to_proto(out.logprobs[0]))
            return response
        except Exception as exc:
            failure = exc
        finally:
            self.counters.num_in_flight -= 1
            if span is not None:
                if failure is not None:
                    self.tracer.fail(span, failure)
                span.end()
        await self._fail(context, "Prefill", request.request_id, failure)

    def _release_source(self, source: worker_pb2.KvSource) -> None:
        """A live migration's KV is not read here: tell its source to free it now (an Abort of the
        suspended request) rather than at the end of its hold."""
        async def abort() -> None:
            with contextlib.suppress(Exception):
                await self.peers.stub(source.address).Abort(
                    worker_pb2.AbortRequest(request_id=source.request_id), timeout=5)
        task = asyncio.ensure_future(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_suspended(self, request: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        """A live migration's source: push the suspended request's KV (migration_source.py)."""
        self._engine_loop(admit=False)                 # a draining worker moves its requests away
        if reason := self._moves_kv():
            raise InvalidRequestError(reason)
        if not request.request_id:
            raise InvalidRequestError("Prefill needs a request_id")
        token_ids = list(request.token_ids)
        num_sent = await self.suspended.send(self.sender, request.request_id, request.migrate_request_id,
                                             token_ids, _transfer_target(request.target))
        self.counters.num_kv_migrations_sent += 1
        log.info("worker %s: sent the KV of %d tokens of %s to %s", self.options.worker_id, num_sent,
                 request.migrate_request_id, request.target.agent_name)
        return worker_pb2.PrefillResponse(num_prompt_tokens=len(token_ids))

    async def Suspend(self, request, context):
        try:
            self._engine_loop(admit=False)             # a draining worker moves its requests away
            if reason := self._moves_kv():
                return worker_pb2.SuspendResponse(suspended=False, reason=reason)
            num_tokens = await self.suspended.suspend(request.request_id, request.hold_s)
            if num_tokens is None:
                return worker_pb2.SuspendResponse(suspended=False, reason=(
                    f"request {request.request_id!r} is not decoding on worker {self.options.worker_id} "
                    "(unknown, finished, or still waiting or prefilling)"))
            self.counters.num_suspended += 1
            log.info("worker %s: suspended %s for a migration (the KV of %d tokens held)",
                     self.options.worker_id, request.request_id, num_tokens)
            return worker_pb2.SuspendResponse(suspended=True, num_tokens=num_tokens)
        except Exception as exc:
            await self._fail(context, "Suspend", request.request_id, exc)

    # -- control -----------------------------------------------------------------
    async def Abort(self, request, context):
        try:
            loop = self._engine_loop(admit=False)
            if self.suspended is not None and self.suspended.take(request.request_id):
                # A suspended request's destination gave its KV up (it recomputes the context instead).
                loop.post(lambda e: e.release_suspended(request.request_id))
                return worker_pb2.AbortResponse(found=True)
            found = await loop.abort_request(request.request_id)
        except Exception as exc:
            await self._fail(context, "Abort", request.request_id, exc)
        return worker_pb2.AbortResponse(found=found)

    async def FenceTransfer(self, request, context):
        try:
            if not request.request_id:
                raise InvalidRequestError("FenceTransfer needs a request_id")
            drained = True                   # a worker still loading has sent nothing
            if self.sender is not None:
                drained = await self.sender.fence(request.request_id, FENCE_DRAIN_TIMEOUT_S)
        except Exception as exc:
            await self._fail(context, "FenceTransfer", request.request_id, exc)
        self.counters.num_fences_served += 1
        return worker_pb2.FenceTransferResponse(drained=drained)

    async def Stats(self, request, context):
        try:
            return await self._engine_loop(admit=False).call(self._stats)
        except Exception as exc:
            await self._fail(context, "Stats", "-", exc)

    async def read_stats(self, timeout_s: float) -> worker_pb2.StatsResponse | None:
        """What Stats answers, computed on the engine thread; None while there is no engine
        (loading, stopped) or when one step outlasts `timeout_s` (the metrics scrape)."""
        loop = self.loop
        if loop is None or not loop.alive:
            return None
        try:
            return await asyncio.wait_for(loop.call(self._stats), timeout_s)
        except (EngineStoppedError, TimeoutError):
            return None

    def _stats(self, engine: Engine) -> worker_pb2.StatsResponse:
        load, c = engine.load(), self.counters
        s = load.counters
        return worker_pb2.StatsResponse(
            worker_id=self.options.worker_id, role=self.options.role.to_proto(), draining=self.draining,
            num_kv_blocks=load.num_kv_blocks, num_used_kv_blocks=load.num_used_kv_blocks,
            num_cached_kv_blocks=load.num_cached_kv_blocks,
            kv_usage=load.num_used_kv_blocks / load.num_kv_blocks if load.num_kv_blocks else 0.0,
            num_running=load.num_running, num_waiting=load.num_waiting,
            num_remote_prefill=load.num_remote_prefill, num_in_flight=c.num_in_flight,
            num_remote_prefill_kv_blocks=load.num_remote_prefill_kv_blocks,
            num_steps=s.num_steps, num_computed_tokens=s.num_computed_tokens,
            num_prompt_tokens_computed=s.num_prompt_tokens_computed,
            num_prefix_hit_tokens=s.num_prefix_hit_tokens, num_generated_tokens=s.num_generated_tokens,
            num_preemptions=s.num_preemptions, num_finished=s.num_finished, num_aborted=s.num_aborted,
            num_requests=c.num_requests, num_local_prefills=c.num_local_prefills,
            num_remote_prefills=c.num_remote_prefills, num_prefills_served=c.num_prefills_served,
            num_errors=c.num_errors, last_kv_event_seq=self.hub.last_seq,
            num_prefill_retries=c.num_prefill_retries, num_prefill_fallbacks=c.num_prefill_fallbacks,
            num_transfer_reservations=self.receiver.num_open() if self.receiver is not None else 0,
            num_held_prefills=load.num_held_prefills, num_fenced_kv_blocks=load.num_fenced_kv_blocks,
            num_fences_confirmed=self.fences.num_confirmed if self.fences is not None else 0,
            num_fences_waited_out=self.fences.num_waited_out if self.fences is not None else 0,
            num_fences_served=c.num_fences_served, num_forks=s.num_forks,
            num_forked_kv_blocks=s.num_forked_blocks, num_fork_copies=s.num_fork_copies,
            kv_tiers=_tier_stats(load), kv_tier_rejections=load.kv_tier_rejections,
            num_suspended=c.num_suspended, num_kv_migrations_sent=c.num_kv_migrations_sent,
            num_kv_migrations_received=c.num_kv_migrations_received,
            num_kv_migration_fallbacks=c.num_kv_migration_fallbacks,
            num_suspended_held=len(self.suspended) if self.suspended is not None else 0)

    async def Describe(self, request, context):
        try:
            engine = self._engine_loop(admit=False).engine
        except Exception as exc:
            await self._fail(context, "Describe", "-", exc)
        d = engine.describe()
        return worker_pb2.DescribeResponse(
            worker_id=self.options.worker_id, instance_id=self.instance_id,
            role=self.options.role.to_proto(), model_name=d.model_name,
            max_model_len=d.max_model_len, vocab_size=d.vocab_size,
            block_size=d.block_size, num_kv_blocks=d.num_kv_blocks, dtype=d.dtype, device=d.device,
            tensor_parallel_size=d.tensor_parallel_size,
            transfer_backend=self.sender.backend if self.sender is not None else "",
            block_hash_extra_key=d.block_hash_extra_key, session_port=self.session_port,
            max_logprobs=d.max_logprobs, kv_transfer_layout=self._transfer_layout(), fingerprint=d.fingerprint,
            moves_kv=not self._moves_kv())

    def _transfer_layout(self) -> str:
        """The layout hash this worker's KV transfer handshakes with; "" without one (role both)."""
        if self.receiver is None or not self.receiver.backend:
            return ""
        return self.receiver.endpoint().layout_hash.decode()

    async def start_draining(self) -> None:
        """Refuse new work (UNAVAILABLE) and report NOT_SERVING; running calls go on."""
        if not self.draining:
            log.info("worker %s: draining", self.options.worker_id)
        self.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def Drain(self, request, context):
        await self.start_draining()
        return worker_pb2.DrainResponse(num_in_flight=self.counters.num_in_flight)

    async def KvEvents(self, request, context):
        try:
            self._engine_loop(admit=False)
        except Exception as exc:
            await self._fail(context, "KvEvents", "-", exc)
        async for batch in self.hub.subscribe(request.since_seq, request.snapshot):
            yield worker_pb2.KvEventBatch(
                worker_id=self.options.worker_id, instance_id=self.instance_id,
                snapshot=batch.snapshot, last_seq=batch.last_seq,
                events=[event_to_proto(e) for e in batch.events])


def _tier_stats(load: EngineLoad) -> list[worker_pb2.KvTierStats]:
    return [worker_pb2.KvTierStats(tier=t.tier, num_blocks=t.num_blocks, capacity_blocks=t.capacity_blocks,
                                   num_hits=t.num_hits, bytes_loaded=t.bytes_loaded, load_seconds=t.load_seconds,
                                   num_written=t.num_written, num_evicted=t.num_evicted)
            for t in load.kv_tiers]
