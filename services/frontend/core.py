"""One request's life in the frontend, shared by the HTTP and the gRPC APIs.

prepare: check the model, tokenize (chat template or plain text), check the
context length and build the engine's SamplingParams — every refusal here is
an APIError with a 4xx. generate: route, call the worker's Generate stream,
turn its tokens into text incrementally (text/stop_checker.py: text is the
frontend's work, workers stop on token ids only; stop strings are judged here
and no partial stop string is ever shown), and record the latency metrics.
Leaving the iteration early (the client went away, or a stop string ended the
request) cancels the worker call, which aborts the request on the worker and
frees its blocks. A worker stream that breaks is continued on another decode
worker (migration.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from splitserve.errors import InvalidRequestError
from splitserve.proto.v1 import common_pb2, worker_pb2
from splitserve.services.text.bad_words import bad_word_token_ids
from splitserve.services.text.stop_checker import StopChecker
from splitserve.services.text.tokenizer import Tokenizer
from splitserve.services.worker_protocol.proto_conversion import finish_reason_from_proto
from splitserve.services.worker_protocol.outputs import FinishReason
from splitserve.services.worker_protocol.sampling_params import SamplingParams, StructuredOutput
from splitserve.tracing import Tracer

from splitserve.services.frontend import metrics as m
from splitserve.services.frontend.errors import APIError, from_grpc, invalid
from splitserve.services.frontend.forks import ENDED, ForkedCall, forkable
from splitserve.services.frontend.generation_request import GenerationRequest
from splitserve.services.frontend.flow_admission import FrontendFlowControl
from splitserve.services.frontend.fault_metrics import OUTCOME_MIGRATED, OUTCOME_RETRIED, PHASE_BEFORE_FIRST_TOKEN, PHASE_STREAMING
from splitserve.services.frontend.metrics import FrontendMetrics
from splitserve.services.frontend.request_tracing import RequestTrace
from splitserve.services.frontend.live_moves import METHOD_KV, METHOD_REPLAY, MoveOrder, MoveResult
from splitserve.services.frontend.migration import MigrationPolicy, Progress, Refusal, breaks_stream
from splitserve.services.frontend.routing import Route, RouteRequest, Router
from splitserve.services.frontend.sampling_defaults import SamplingDefaults
from splitserve.services.frontend.workers.session import WorkerCallError
from splitserve.services.frontend.workers.pool import WorkerPool

log = logging.getLogger(__name__)
ROUTE_POLL_S = 0.1     # how often a migration waiting for a decode worker looks again
# Prompt logprob entries (each prompt token's own and its top-n) one worker message may carry:
# about 14 bytes each on the wire, so well within the session stream's and gRPC's 64 MiB.
MAX_PROMPT_LOGPROB_ENTRIES = 2_000_000


@dataclass(slots=True)
class Delta:
    """What one worker message adds: new text and tokens; the last has finish_reason."""

    text: str
    token_ids: list[int]
    logprobs: list[common_pb2.TokenLogprob]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    # With the first token, when params.prompt_logprobs was set: prompt tokens 1.. (none for
    # a one-token prompt); None in every other delta.
    prompt_logprobs: list[common_pb2.TokenLogprob] | None = None
    # vLLM's stop_reason, with the last delta: the stop string or the stop_token_ids entry that
    # ended the request; None for EOS, max_tokens and every other end.
    stop_reason: str | int | None = None


@dataclass(slots=True)
class SamplingRequest:
    """The sampling fields common to every API, as the client sent them (None: omitted, so the
    frontend's sampling defaults apply: the model's generation config, else the engine's)."""

    max_tokens: int | None
    default_max_tokens: int | None  # None: the rest of the context
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    max_tokens_param: str = "max_tokens"
    logprobs_param: str = "logprobs"      # the request's name for it (chat: top_logprobs)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True      # for the text only: not a worker parameter
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> bias
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    structured: StructuredOutput | None = None     # response_format / guided_* / a forced tool call
    allowed_token_ids: list[int] = field(default_factory=list)
    bad_words: list[str] = field(default_factory=list)   # text: tokenized here (text/bad_words.py)
    cache_salt: str = ""
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] = field(default_factory=list)   # vLLM's: these tokens' logprobs, not the top-n

    @property
    def caps_output(self) -> bool:
        """The output has a cap the client chose (or its API's default), not the rest of the context."""
        return self.max_tokens is not None or self.default_max_tokens is not None


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Frontend:
    def __init__(self, tokenizer: Tokenizer, pool: WorkerPool, router: Router, metrics: FrontendMetrics,
                 served_model_name: str | None = None, migration: MigrationPolicy | None = None,
                 sampling_defaults: SamplingDefaults | None = None, tracer: Tracer | None = None):
        self.tokenizer = tokenizer
        self.pool = pool
        self.router = router
        self.metrics = metrics
        self.served_model_name = served_model_name
        self.migration = migration or MigrationPolicy()
        self.sampling_defaults = sampling_defaults or SamplingDefaults()   # for omitted parameters
        self.tracer = tracer           # None: tracing is off (--otlp-traces-endpoint)
        self.tool_parser: str | None = None   # --tool-call-parser with --enable-auto-tool-choice
        self.draining = False          # shutting down: refuse new requests, finish running ones
        self.flow_control: FrontendFlowControl | None = None   # --flow-control: admission before routing
        # Gateway mode (--gateway): an endpoint picker routes; its prefill pick comes in a header.
        self.gateway = False
        self.num_in_flight = 0
        self.running: dict[str, tuple[Progress, "_Run"]] = {}   # by request id: what an operator may move
        self._moves_off: set[asyncio.Task] = set()

    # -- moving a running request (live_moves.py) ------------------------------------
    def running_requests(self) -> list[dict]:
        """What runs now, for an operator picking a request to move (GET /admin/requests)."""
        return [{"request_id": rid, "worker": run.worker_id, "num_prompt_tokens": len(p.prompt_ids),
                 "num_output_tokens": p.num_output_tokens, "moving": run.move is not None}
                for rid, (p, run) in self.running.items()]

    async def move(self, request_id: str, to_worker: str | None = None, replay: bool = False,
                   timeout_s: float = 60.0) -> MoveResult:
        """Move a running request to another decode worker (`to_worker`, or the router's pick) after
        its next token; returns once the new worker forwarded a token. APIError: 404 no such
        request running, 409 already moving or ended first, 400 no such decode worker."""
        found = self.running.get(request_id)
        if found is None:
            raise APIError(404, f"no request {request_id!r} is running on this frontend", type="not_found_error")
        progress, run = found
        if run.move is not None:
            raise APIError(409, f"request {request_id!r} is already being moved", type="conflict_error")
        if run.forked:
            raise APIError(409, f"request {request_id!r} is one of several samples of a prompt (n > 1) that share "
                                "one worker call; it can move once that call broke", type="conflict_error")
        if to_worker is not None:
            self._check_move_target(progress, run, to_worker)
        elif not self._move_targets(progress, run.worker_id):
            raise APIError(409, f"no other decode worker that can continue request {request_id!r} (the same "
                                "weights revision) is ready", type="conflict_error")
        order = run.move = MoveOrder(to_worker, replay)
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(order.result)
        except TimeoutError:
            if not order.begun and run.move is order:
                run.move = None           # no delta came: the request stays where it is
            raise APIError(504, f"request {request_id!r} did not produce a token on another worker within "
                                f"{timeout_s:.0f} s", type="timeout_error") from None

    def move_all_off(self, worker_id: str) -> None:
        """Move every request running on decode worker `worker_id` (it drains) to the others, those
        for which another (of their weights revision) is ready; the rest finish there or migrate
        at its drain timeout, as before."""
        for request_id, (progress, run) in list(self.running.items()):
            if (run.worker_id == worker_id and run.move is None and not run.forked and not run.finished
                    and self._move_targets(progress, worker_id)):
                task = asyncio.ensure_future(self._move_off(request_id, worker_id))
                self._moves_off.add(task)
                task.add_done_callback(self._moves_off.discard)

    async def _move_off(self, request_id: str, worker_id: str) -> None:
        try:
            moved = await self.move(request_id)
        except APIError as exc:
            log.info("request %s: not moved off draining %s: %s", request_id, worker_id, exc.message)
        else:
            log.info("request %s: moved off draining %s to %s (%s)", request_id, worker_id, moved.to_worker,
                     moved.method)

    def _move_targets(self, progress: Progress, worker_id: str) -> list:
        """The ready decode workers but `worker_id` that may continue the request: of the weights
        revision that began it."""
        return [w for w in self.pool.ready("decode") if w.worker_id != worker_id and not (
                progress.fingerprint and w.info.fingerprint and w.info.fingerprint != progress.fingerprint)]

    def _check_move_target(self, progress: Progress, run: "_Run", to_worker: str) -> None:
        ready = {w.worker_id: w for w in self.pool.ready("decode")}
        worker = ready.get(to_worker)
        if worker is None:
            known = ", ".join(sorted(ready)) or "none"
            raise invalid(f"{to_worker!r} is not a ready decode worker (ready: {known})", "to")
        if to_worker == run.worker_id:
            raise invalid(f"request {progress.request_id!r} already runs on {to_worker!r}", "to")
        if progress.fingerprint and worker.info.fingerprint and worker.info.fingerprint != progress.fingerprint:
            raise invalid(f"{to_worker!r} serves other weights than the ones that began this response", "to")

    # -- what the workers serve ----------------------------------------------------
    @property
    def model_name(self) -> str | None:
        if self.served_model_name:
            return self.served_model_name
        infos = [w.info for w in self.pool.workers if w.info is not None]
        return infos[0].model_name if infos else None

    @property
    def max_model_len(self) -> int | None:
        lens = [w.info.max_model_len for w in self.pool.ready("decode")]
        return min(lens) if lens else None

    @property
    def vocab_size(self) -> int:
        """The served model's vocabulary (the workers', as vLLM's -1 logprobs counts it)."""
        sizes = [w.info.vocab_size for w in self.pool.ready("decode") if w.info.vocab_size]
        return min(sizes) if sizes else self.tokenizer.vocab_size

    @property
    def max_logprobs(self) -> int:
        """vLLM's --max-logprobs of the workers (the lowest; -1: the whole vocabulary)."""
        limits = [w.info.max_logprobs if w.info.HasField("max_logprobs") else SamplingParams.DEFAULT_MAX_LOGPROBS
                  for w in self.pool.ready("decode")]
        resolved = [self.vocab_size if n == -1 else n for n in limits]
        return min(resolved) if resolved else SamplingParams.DEFAULT_MAX_LOGPROBS

    def is_ready(self) -> bool:
        return not self.draining and bool(self.pool.ready("decode"))

    async def drain(self, timeout_s: float) -> int:
        """Stop admitting requests (/ready fails, new ones get 503) and wait up to `timeout_s`
        for the running ones to end; returns how many are still running."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self._num_accepted() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self._num_accepted()

    def _num_accepted(self) -> int:
        """Requests running, and those waiting in flow control's queues (they were accepted too)."""
        return self.num_in_flight + (self.flow_control.num_queued() if self.flow_control is not None else 0)

    # -- prepare -------------------------------------------------------------------
    def unavailable(self) -> APIError | None:
        """Why this frontend cannot serve its model now (a 503), or None when it can."""
        if self.draining:
            return APIError(503, "this frontend is shutting down; retry on another one", type="service_unavailable")
        if self.model_name is None or not self.is_ready():
            return APIError(503, "no worker is ready yet; retry shortly", type="service_unavailable")
        return None

    def check_model(self, name: str) -> None:
        if (error := self.unavailable()) is not None:
            raise error
        served = self.model_name
        if name != served:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served!r}",
                           param="model", code="model_not_found")

    def chat_prompt(self, messages: list[dict], **options) -> list[int]:
        """The chat's prompt ids; `options`: Tokenizer.apply_chat_template's (generation prompt,
        continue the final message, special tokens, template variables)."""
        try:
            return self.tokenizer.apply_chat_template(messages, **options)
        except InvalidRequestError as exc:
            raise invalid(str(exc), "messages") from exc

    def text_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if not prompt:      # before encoding: "" would still become [BOS]
            raise invalid("the prompt is empty", "prompt")
        ids = self.tokenizer.encode(prompt, add_special_tokens) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise invalid("the prompt is empty", "prompt")
        return ids

    def sampling_params(self, s: SamplingRequest, num_prompt_tokens: int) -> SamplingParams:
        context = self.max_model_len
        if context is None:
            raise APIError(503, "no worker is ready yet; retry shortly", type="service_unavailable")
        room = context - num_prompt_tokens
        if room < 1:
            raise invalid(f"this model's maximum context length is {context} tokens, but the prompt has "
                          f"{num_prompt_tokens} tokens (at least one must be left to generate)",
                          "messages" if s.max_tokens_param == "max_completion_tokens" else "prompt",
                          "context_length_exceeded")
        max_tokens = s.max_tokens if s.max_tokens is not None else (s.default_max_tokens or room)
        if max_tokens < 1:
            raise invalid(f"{s.max_tokens_param} must be at least 1, got {max_tokens}",
                          s.max_tokens_param, "invalid_value")
        if max_tokens > room:
            raise invalid(f"{s.max_tokens_param} is too large: this model's maximum context length is "
                          f"{context} tokens and the prompt has {num_prompt_tokens}, so at most {room} "
                          f"can be generated; you asked for {max_tokens}", s.max_tokens_param,
                          "context_length_exceeded")
        logprobs, prompt_logprobs = self._logprob_counts(s, num_prompt_tokens)
        d = self.sampling_defaults
        params = SamplingParams(
            max_tokens=max_tokens, temperature=d.temperature_or(s.temperature), top_p=d.top_p_or(s.top_p),
            top_k=d.top_k_or(s.top_k), min_p=d.min_p_or(s.min_p), seed=s.seed, stop=list(s.stop),
            ignore_eos=s.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=s.include_stop_str_in_output,
            presence_penalty=s.presence_penalty or 0.0, frequency_penalty=s.frequency_penalty or 0.0,
            repetition_penalty=d.repetition_penalty_or(s.repetition_penalty),
            # Like vLLM's server: a bias beyond +-100 is clamped, not refused.
            logit_bias={t: min(100.0, max(-100.0, b)) for t, b in s.logit_bias.items()},
            min_tokens=s.min_tokens, stop_token_ids=list(s.stop_token_ids), structured=s.structured,
            allowed_token_ids=list(s.allowed_token_ids),
            bad_words=bad_word_token_ids(self.tokenizer, s.bad_words) if s.bad_words else [],
            cache_salt=s.cache_salt, prompt_logprobs=prompt_logprobs, logprob_token_ids=list(s.logprob_token_ids))
        try:
            params.validate()
        except InvalidRequestError as exc:
            raise invalid(str(exc)) from exc
        return params

    def _logprob_counts(self, s: SamplingRequest, num_prompt_tokens: int) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) for the workers: vLLM's -1 is the whole vocabulary, and
        neither may exceed the workers' --max-logprobs (vLLM's check and words)."""
        asked = (("sample logprobs of", s.logprobs_param, s.logprobs),
                 ("prompt logprobs of", "prompt_logprobs", s.prompt_logprobs),
                 ("logprob_token_ids of length", "logprob_token_ids", len(s.logprob_token_ids) or None))
        if all(n is None for _, _, n in asked):
            return None, None
        limit, vocab = self.max_logprobs, self.vocab_size
        counts = []
        for what, name, n in asked:
            n = vocab if n == -1 else n
            if n is not None and n > limit:
                raise invalid(f"Requested {what} {n}, which is greater than max allowed: {limit}", name,
                              "invalid_value")
            counts.append(n)
        logprobs, prompt_logprobs = counts[0], counts[1]
        # A worker sends a request's prompt logprobs in one message (its first), under the frame limit.
        num_entries = (num_prompt_tokens - 1) * (prompt_logprobs + 1) if prompt_logprobs is not None else 0
        if num_entries > MAX_PROMPT_LOGPROB_ENTRIES:
            raise invalid(f"prompt_logprobs={s.prompt_logprobs} over a prompt of {num_prompt_tokens} tokens is "
                          f"{num_entries} logprobs, more than the "
                          f"{MAX_PROMPT_LOGPROB_ENTRIES} one worker message carries; ask for fewer or a shorter "
                          f"prompt", "prompt_logprobs", "invalid_value")
        return logprobs, prompt_logprobs

    # -- generate ------------------------------------------------------------------
    def generate_forked(self, reqs: list[GenerationRequest]) -> tuple[list[AsyncIterator[Delta]], ForkedCall | None]:
        """The deltas of several samples of one prompt (n > 1), sent as one worker request that
        prefills the prompt once (forks.py); choices that are not such samples run apart.
        The ForkedCall (None when apart) is to be closed once the streams are."""
        if len(reqs) < 2 or not forkable(reqs):
            return [self.generate(r) for r in reqs], None
        call = ForkedCall(reqs)
        return [self.generate(r, (call, i)) for i, r in enumerate(reqs)], call

    async def generate(self, req: GenerationRequest, fork: tuple[ForkedCall, int] | None = None
                       ) -> AsyncIterator[Delta]:
        """Stream the request's deltas; when a worker's stream breaks, continue on another
        decode worker (migration.py) so the caller sees one uninterrupted stream. `fork`: this
        request is choice i of a ForkedCall, whose shared stream is its first attempt."""
        progress = Progress(req.request_id, req.prompt_ids, req.params)
        run = _Run(StopChecker(self.tokenizer, req.params, req.prompt_ids, req.skip_special_tokens))
        faults = self.metrics.faults
        status, failure = m.STATUS_ERROR, "error"
        self.metrics.in_flight.inc()
        self.metrics.admitted.inc()
        self.metrics.admitted_prompt_tokens.inc(len(req.prompt_ids))
        if req.max_tokens_from_client:
            self.metrics.admitted_capped.inc()
            self.metrics.admitted_max_tokens.inc(req.params.max_tokens)
        self.num_in_flight += 1
        trace = RequestTrace(self.tracer, req, self.model_name) if self.tracer is not None else None
        self.running[req.request_id] = (progress, run)
        try:
            while True:
                run.forked = fork is not None
                if fork is not None:
                    attempt, fork = self._forked_attempt(req, *fork, progress, run, trace), None
                else:
                    routing = self.route(req, progress)
                    route = await (routing if trace is None else trace.route(routing))
                    attempt = self._attempt(req, route, progress, run, trace)
                async with contextlib.aclosing(attempt) as deltas:
                    async for delta in deltas:
                        yield delta
                if run.finished:
                    return
                if run.move is not None and run.move.begun:
                    if not progress.moved_from:
                        self._prepare_move(req, progress, run.move)
                        continue
                    # The worker it moved to failed before its first token: a migration from here on.
                    run.move.ended(APIError(502, f"the worker the request moved to failed: {run.broken}",
                                            type="service_unavailable"))
                    run.move, progress.kv_source, progress.move_to, progress.moved_from = None, None, None, ""
                elif run.move is not None:
                    run.move.ended(APIError(409, f"the stream of request {req.request_id!r} broke before it could "
                                                 "move; it continues by token replay", type="conflict_error"))
                    run.move = None
                self._migrate(req, progress, run.broken, run.worker_id)
                if trace is not None:
                    trace.migrating(progress, run.worker_id, run.broken)
        except _Refused as refused:
            status, failure = m.STATUS_UNAVAILABLE, refused.reason
            raise refused.error from None
        except APIError as error:
            status = m.STATUS_INVALID if error.status < 500 else m.STATUS_UNAVAILABLE
            failure = run.failure or "error"
            raise
        except (asyncio.CancelledError, GeneratorExit):
            if run.finished:       # closed after its last delta: not a cancellation
                raise
            status = m.STATUS_CANCELLED
            phase = PHASE_STREAMING if progress.token_ids else PHASE_BEFORE_FIRST_TOKEN
            faults.cancellations.labels(req.api, phase).inc()
            log.info("request %s: cancelled by the client after %d tokens", req.request_id,
                     progress.num_output_tokens)
            raise
        finally:
            self.running.pop(req.request_id, None)
            if run.move is not None:
                run.move.ended(APIError(409, f"request {req.request_id!r} ended before it could move "
                                             f"({run.finish_reason or status})", type="conflict_error"))
            if run.finished:
                status = m.STATUS_OK
                self.metrics.prompt_tokens.inc(len(req.prompt_ids))
                self.metrics.e2e.observe(time.monotonic() - req.arrival)
            self.metrics.in_flight.dec()
            self.num_in_flight -= 1
            self.metrics.generation_tokens.inc(progress.num_output_tokens)
            self.metrics.requests.labels(req.api, status).inc()
            if status in (m.STATUS_UNAVAILABLE, m.STATUS_ERROR):
                faults.failures.labels(req.api, failure).inc()
            if trace is not None:
                trace.finish(progress, run.finish_reason, run.first_token_at, None if run.finished else status)

    def _prepare_move(self, req: GenerationRequest, progress: Progress, order: MoveOrder) -> None:
        """The stream was left for a move: the next attempt goes to the chosen worker (or any but
        the source) and reads the KV from the suspended request, when it was suspended."""
        progress.num_moves += 1
        progress.kv_source = order.kv_source
        progress.move_to, progress.moved_from = order.to_worker, order.from_worker
        log.info("request %s: moving from %s after %d tokens (%s)", req.request_id, order.from_worker,
                 progress.num_output_tokens, "its KV moves" if order.kv_source is not None
                 else f"token replay: {order.replay_reason}")

    def _excluded(self, progress: Progress) -> frozenset[str]:
        """The workers whose stream broke for this request, unless restarted since (a new instance),
        and, once tokens were forwarded, the workers of another fingerprint (weights revision) than
        the one that produced them: the rest of a response comes from the weights that began it;
        and during a move, every worker but the one asked for (or the one it leaves)."""
        if not progress.failed_worker_ids and not progress.moved_from:
            return frozenset()            # every request's first route: nothing to look up
        ready = self.pool.ready("decode")
        restarted = {w.worker_id for w in ready if w.info is not None
                     and progress.failed_instances.get(w.worker_id, w.info.instance_id) != w.info.instance_id}
        other_revision = set()
        if progress.token_ids and progress.fingerprint:
            other_revision = {w.worker_id for w in ready if w.info is not None
                              and w.info.fingerprint and w.info.fingerprint != progress.fingerprint}
        # A move goes to the worker asked for, else anywhere but where the request ran.
        moving = {w.worker_id for w in ready if w.worker_id != progress.move_to} if progress.move_to \
            else {progress.moved_from} - {""}
        return frozenset((progress.failed_worker_ids - restarted) | other_revision | moving)

    async def route(self, req: GenerationRequest, progress: Progress) -> Route:
        request = RouteRequest(progress.attempt_id(), progress.prompt_ids + progress.token_ids,
                               progress.params.cache_salt)
        route = self.router.route(request, exclude=self._excluded(progress))
        if route is None and progress.move_to:
            progress.move_to = None       # the worker chosen for a move left: any other will do
            route = self.router.route(request, exclude=self._excluded(progress))
        if route is None and not progress.num_migrations and not progress.num_moves:
            raise _Refused("no_worker", APIError(503, "no worker is ready to serve this request; retry shortly",
                                                 type="service_unavailable"))
        if route is None:
            # A migration with no decode worker left (the only one is restarting): wait for one.
            deadline = time.monotonic() + self.migration.wait_s
            log.warning("request %s: no decode worker to continue on; waiting up to %.0f s for one",
                        req.request_id, self.migration.wait_s)
            while route is None and time.monotonic() < deadline and not self.draining:
                await asyncio.sleep(ROUTE_POLL_S)
                route = self.router.route(request, exclude=self._excluded(progress))
        if route is None:
            raise self._refuse(req, progress, Refusal.NO_WORKER)
        if not progress.token_ids and route.decode.info is not None:
            progress.fingerprint = route.decode.info.fingerprint
        if progress.num_migrations:
            outcome = OUTCOME_MIGRATED if progress.token_ids else OUTCOME_RETRIED
            self.metrics.faults.migrations.labels(outcome).inc()
            log.warning("request %s: %s to %s after %d tokens (attempt %d)", req.request_id, outcome,
                        route.decode.worker_id, progress.num_output_tokens, progress.num_migrations + 1)
        return route

    def _migrate(self, req: GenerationRequest, progress: Progress, broken: str, worker_id: str) -> None:
        """The stream from `worker_id` broke: exclude it and allow one more attempt, or raise."""
        log.warning("request %s: the stream from %s broke after %d tokens: %s", req.request_id, worker_id,
                    progress.num_output_tokens, broken)
        progress.failed_worker_ids.add(worker_id)
        broken_on = next((w for w in self.pool.workers if w.worker_id == worker_id and w.info is not None), None)
        if broken_on is not None:
            progress.failed_instances[worker_id] = broken_on.info.instance_id
        refusal = self.migration.refusal(progress, self.max_model_len)
        if refusal is not None:
            raise self._refuse(req, progress, refusal, broken)
        progress.num_migrations += 1

    def _refuse(self, req: GenerationRequest, progress: Progress, refusal: Refusal,
                broken: str = "") -> "_Refused":
        self.metrics.faults.migrations.labels(f"refused_{refusal.value}").inc()
        log.warning("request %s: not migrated after %d tokens: %s", req.request_id, progress.num_output_tokens,
                    refusal.message)
        cause = f" ({broken})" if broken else ""
        return _Refused(refusal.value, APIError(
            503, f"the worker serving this request failed{cause} and the request could not be moved to "
                 f"another worker: {refusal.message}", type="service_unavailable"))

    async def _attempt(self, req: GenerationRequest, route: Route, progress: Progress,
                       run: "_Run", trace: RequestTrace | None = None) -> AsyncIterator[Delta]:
        """One worker call. Ends with run.finished, or run.broken set (migrate), or raises the
        worker's refusal of the request as an APIError."""
        message = progress.worker_request()
        self.add_prefill_peers(message, route, req.prefill_address)
        call_span = trace.start_call(message, route) if trace is not None else None
        log.info("request %s: %d prompt tokens -> %s (%s)", message.request_id, len(message.token_ids),
                 route.decode.worker_id, route.reason)
        run.broken, run.first_of_attempt, run.worker_id = "", True, route.decode.worker_id
        try:
            async with contextlib.aclosing(route.decode.generate(message)) as responses:
                async for resp in responses:
                    delta = self._delta(req, progress, run, resp, message.request_id)
                    run.finished = delta.finish_reason is not None
                    if run.move is not None and run.move.begun and resp.token_ids:
                        self._moved(progress, run, route.decode.worker_id, resp.kv_moved)
                    yield delta
                    if run.finished:      # leaving aclosing aborts the worker's request if it goes on
                        return
                    if run.move is not None and not run.move.begun:
                        await run.move.leave(route.decode, message.request_id, progress.num_output_tokens)
                        run.broken = f"moved to {run.move.to_worker or 'another decode worker'} by an operator"
                        return            # leaving aclosing aborts the request (a suspended one is kept)
            run.broken = "the worker ended the stream without finishing the request"
        except WorkerCallError as exc:
            self._broken_or_refused(run, exc)
        finally:
            self.router.on_finished(message.request_id)
            if call_span is not None:
                trace.end_call(call_span, run.broken or run.failure)

    def _moved(self, progress: Progress, run: "_Run", worker_id: str, kv_moved: bool) -> None:
        """The first token after a move: it is over."""
        self.metrics.faults.moves.labels(METHOD_KV if kv_moved else METHOD_REPLAY).inc()
        run.move.arrived(progress.request_id, worker_id, kv_moved)
        run.move = None
        progress.kv_source, progress.move_to, progress.moved_from = None, None, ""

    def add_prefill_peers(self, message: worker_pb2.TokenGenerateRequest, route: Route,
                          gateway_prefill: str = "") -> None:
        """The prefill worker the decode worker is to ask: the router's pick, or in gateway mode the
        endpoint picker's (`gateway_prefill`, which no pool of this frontend knows)."""
        if gateway_prefill:
            message.prefill_peer.CopyFrom(worker_pb2.PrefillPeer(worker_id=gateway_prefill, address=gateway_prefill))
            return
        if route.prefill is not None:
            message.prefill_peer.CopyFrom(worker_pb2.PrefillPeer(worker_id=route.prefill.worker_id,
                                                                 address=route.prefill.address))
            # The decode worker tries these when the chosen one fails, then prefills locally.
            message.alternate_prefill_peers.extend(
                worker_pb2.PrefillPeer(worker_id=w.worker_id, address=w.address)
                for w in self.pool.ready("prefill") if w is not route.prefill)

    @staticmethod
    def _broken_or_refused(run: "_Run", exc: WorkerCallError) -> None:
        """A failed worker call: mark the stream broken (migrate), or raise the refusal."""
        if not breaks_stream(exc):
            run.failure = exc.code().name.lower()
            raise from_grpc(exc) from None
        run.broken = f"{exc.code().name}: {exc.details()}"

    async def _forked_attempt(self, req: GenerationRequest, call: ForkedCall, choice: int,
                              progress: Progress, run: "_Run", trace: RequestTrace | None = None
                              ) -> AsyncIterator[Delta]:
        """Choice `choice`'s part of a ForkedCall, as `_attempt` reads a call of its own."""
        run.broken, run.first_of_attempt = "", True
        try:
            run.worker_id = (await call.start(self, progress, trace)).decode.worker_id
            inbox = call.inboxes[choice]
            while (item := await inbox.get()) is not ENDED:
                if isinstance(item, WorkerCallError):
                    self._broken_or_refused(run, item)
                    return
                delta = self._delta(req, progress, run, item, call.request_id)
                run.finished = delta.finish_reason is not None
                if run.finished:
                    # Now, not when this generator is closed: a reader stops at the last delta,
                    # and the worker's sample (a stop string ended it here) should stop too.
                    call.release(choice)
                yield delta
                if run.finished:
                    return
            run.broken = "the worker ended the stream without finishing the request"
        finally:
            call.release(choice)

    def _delta(self, req: GenerationRequest, progress: Progress, run: "_Run",
               resp: worker_pb2.TokenGenerateResponse, attempt_id: str) -> Delta:
        """Account one worker message and turn it into the client's delta. The frontend decides
        stop strings (the worker never sees text) and max_tokens (after a migration the worker
        only sees part of the output), the worker decides EOS and the context limit."""
        token_ids, logprobs = list(resp.token_ids), list(resp.logprobs)
        if token_ids:
            now = time.monotonic()
            if run.last_token_at is None:
                self.metrics.ttft.observe(now - req.arrival)
                run.first_token_at = now
            else:
                self.metrics.itl.observe((now - run.last_token_at) / len(token_ids))
            if run.first_of_attempt:
                self.router.on_first_token(attempt_id)
                run.first_of_attempt = False
            run.last_token_at = now
        reason = None
        for i, token_id in enumerate(token_ids):
            progress.token_ids.append(token_id)
            if run.checker.add(token_id):
                reason = FinishReason.STOP
            elif progress.num_output_tokens >= req.params.max_tokens:
                reason = FinishReason.LENGTH
            if reason is not None:
                token_ids, logprobs = token_ids[:i + 1], logprobs[:i + 1]
                break
        if reason is None and resp.finished:
            reason = finish_reason_from_proto(resp.finish_reason)
        if progress.num_cached_tokens is None:
            progress.num_cached_tokens = min(resp.num_cached_tokens, len(progress.prompt_ids))
        if reason is not None:
            run.checker.finish()
            run.finish_reason = reason.value
        prompt_logprobs = list(resp.prompt_logprobs) if req.params.prompt_logprobs is not None and token_ids \
            and progress.num_output_tokens == len(token_ids) else None         # the request's first tokens
        return Delta(run.checker.take_text(), token_ids, logprobs, reason.value if reason is not None else None,
                     len(progress.prompt_ids), progress.num_cached_tokens, progress.num_output_tokens,
                     prompt_logprobs, self._stop_reason(req.params, run.checker, reason, token_ids))

    def _stop_reason(self, params: SamplingParams, checker: StopChecker, reason: FinishReason | None,
                     token_ids: list[int]) -> str | int | None:
        """vLLM's: the stop string, else a stop token id (EOS counts as no reason, as in vLLM)."""
        if reason is not FinishReason.STOP:
            return None
        if checker.matched_stop is not None:
            return checker.matched_stop
        last = token_ids[-1] if token_ids else None
        if last in params.stop_token_ids and (params.ignore_eos or last not in self.tokenizer.eos_token_ids):
            return last
        return None


@dataclass(slots=True)
class _Run:
    """Per-request streaming state shared by its attempts."""

    checker: StopChecker
    last_token_at: float | None = None
    first_token_at: float | None = None
    finish_reason: str | None = None
    first_of_attempt: bool = True
    finished: bool = False
    broken: str = ""              # why the last attempt's stream broke
    worker_id: str = ""           # the decode worker of the last attempt
    failure: str = ""             # the worker's refusal (gRPC status, lower case)
    move: MoveOrder | None = None  # an operator's move, until the new worker's first token
    forked: bool = False           # reading a shared call of n > 1 samples (it cannot move then)


class _Refused(Exception):
    """A request that cannot be served or continued; `reason` labels the failure metric."""

    def __init__(self, reason: str, error: APIError):
        super().__init__(error.message)
        self.reason = reason
        self.error = error
