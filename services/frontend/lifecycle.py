"""One request's life in the frontend, shared by the HTTP and the gRPC APIs.

prepare: check the model, tokenize (chat template or plain text), check the
context length and build the engine's SamplingParams — every refusal here is
an APIError with a 4xx. generate: route, call the worker's Generate stream,
turn its tokens into text incrementally (the same StopChecker the engine
uses, so stop strings are cut exactly as the engine cuts them and no partial
stop string is ever shown), and record the latency metrics. Leaving the
iteration early (the client went away) cancels the worker call, which aborts
the request on the worker and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from splitserve.errors import InvalidRequestError
from splitserve.proto.v1 import common_pb2, worker_pb2
from splitserve.services.engine.sampling_params import SamplingParams
from splitserve.services.engine.stop_checker import StopChecker
from splitserve.services.engine.tokenizer import Tokenizer
from splitserve.services.worker.convert import finish_reason_from_proto, params_to_proto

from . import metrics as m
from .errors import APIError, from_grpc, invalid
from .metrics import FrontendMetrics
from .routing import RouteRequest, Router
from .workers import WorkerPool

log = logging.getLogger(__name__)


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    api: str                        # chat | completions | grpc (metrics label)
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)


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


@dataclass(slots=True)
class SamplingRequest:
    """The sampling fields common to every API, as the client sent them."""

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


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Frontend:
    def __init__(self, tokenizer: Tokenizer, pool: WorkerPool, router: Router, metrics: FrontendMetrics,
                 served_model_name: str | None = None):
        self.tokenizer = tokenizer
        self.pool = pool
        self.router = router
        self.metrics = metrics
        self.served_model_name = served_model_name

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

    def is_ready(self) -> bool:
        return bool(self.pool.ready("decode"))

    # -- prepare -------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        served = self.model_name
        if served is None or not self.is_ready():
            raise APIError(503, "no worker is ready yet; retry shortly", type="service_unavailable")
        if name != served:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served!r}",
                           param="model", code="model_not_found")

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        try:
            return self.tokenizer.apply_chat_template(messages)
        except InvalidRequestError as exc:
            raise invalid(str(exc), "messages") from exc

    def text_prompt(self, prompt: str | list[int]) -> list[int]:
        if not prompt:      # before encoding: "" would still become [BOS]
            raise invalid("the prompt is empty", "prompt")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
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
        params = SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if s.temperature is None else s.temperature,
            top_p=1.0 if s.top_p is None else s.top_p, top_k=s.top_k or 0, min_p=s.min_p or 0.0,
            seed=s.seed, stop=list(s.stop), ignore_eos=s.ignore_eos, logprobs=s.logprobs)
        try:
            params.validate()
        except InvalidRequestError as exc:
            raise invalid(str(exc)) from exc
        return params

    # -- generate ------------------------------------------------------------------
    async def generate(self, req: GenerationRequest) -> AsyncIterator[Delta]:
        route = self.router.route(RouteRequest(req.request_id, req.prompt_ids))
        if route is None:
            self.metrics.requests.labels(req.api, m.STATUS_UNAVAILABLE).inc()
            raise APIError(503, "no worker is ready to serve this request; retry shortly",
                           type="service_unavailable")
        message = worker_pb2.TokenGenerateRequest(
            request_id=req.request_id, token_ids=req.prompt_ids, params=params_to_proto(req.params))
        if route.prefill is not None:
            message.prefill_peer.CopyFrom(worker_pb2.PrefillPeer(worker_id=route.prefill.worker_id,
                                                                 address=route.prefill.address))
            # The decode worker tries these when the chosen one fails, then prefills locally.
            message.alternate_prefill_peers.extend(
                worker_pb2.PrefillPeer(worker_id=w.worker_id, address=w.address)
                for w in self.pool.ready("prefill") if w is not route.prefill)
        log.info("request %s: %d prompt tokens -> %s (%s)", req.request_id, len(req.prompt_ids),
                 route.decode.worker_id, route.reason)
        checker = StopChecker(self.tokenizer, req.params, set())
        call = route.decode.stub.Generate(message)
        status, last_token_at, num_output = m.STATUS_ERROR, None, 0
        self.metrics.in_flight.inc()
        try:
            async for resp in call:
                now = time.monotonic()
                if resp.token_ids:
                    if last_token_at is None:
                        self.metrics.ttft.observe(now - req.arrival)
                        self.router.on_first_token(req.request_id)
                    else:
                        self.metrics.itl.observe((now - last_token_at) / len(resp.token_ids))
                    last_token_at = now
                for token_id in resp.token_ids:
                    num_output += 1
                    checker.add(token_id, num_output)
                reason = finish_reason_from_proto(resp.finish_reason) if resp.finished else None
                if resp.finished:
                    checker.finish()
                yield Delta(checker.take_text(), list(resp.token_ids), list(resp.logprobs),
                            reason.value if reason is not None else None, resp.num_prompt_tokens,
                            resp.num_cached_tokens, resp.num_output_tokens)
                if resp.finished:
                    status = m.STATUS_OK
                    self.metrics.prompt_tokens.inc(resp.num_prompt_tokens)
                    self.metrics.e2e.observe(time.monotonic() - req.arrival)
                    break
        except grpc.aio.AioRpcError as exc:
            error = from_grpc(exc)
            status = m.STATUS_INVALID if error.status < 500 else m.STATUS_UNAVAILABLE
            raise error from None
        except (asyncio.CancelledError, GeneratorExit):
            status = m.STATUS_CANCELLED
            raise
        finally:
            call.cancel()
            self.metrics.in_flight.dec()
            self.metrics.generation_tokens.inc(num_output)
            self.metrics.requests.labels(req.api, status).inc()
            self.router.on_finished(req.request_id)
            if status == m.STATUS_CANCELLED:
                log.info("request %s: cancelled by the client after %d tokens", req.request_id, num_output)
