"""The public gRPC Inference service: Generate with the HTTP API's parameters.

Same lifecycle as HTTP (Frontend.prepare + generate); a refusal becomes a gRPC
status (INVALID_ARGUMENT for what HTTP answers with 400, NOT_FOUND for an
unknown model, UNAVAILABLE when no worker is ready). Cancelling the call
cancels the worker call, as a disconnect does for HTTP. With --flow-control the
call is admitted as an HTTP request is (`priority` field; fairness id and TTFT
deadline from the call's metadata, the API key's id when keys are on); a shed call
ends with RESOURCE_EXHAUSTED and the reason in the trailing metadata
x-llm-d-request-dropped-reason (and retry-after). `beam_width` runs the
HTTP API's beam search (beam_search.py) and answers one finished message per beam.
"""

from __future__ import annotations

import contextlib

import grpc

from splitserve.proto.v1 import inference_pb2, inference_pb2_grpc
from splitserve.services.flow_control import DROPPED_REASON_HEADER
from splitserve.services.worker_protocol.proto_conversion import finish_reason_to_proto
from splitserve.services.worker_protocol.outputs import FinishReason
from splitserve.services.worker_protocol.sampling_params import StructuredOutput
from splitserve.tracing import TraceContext

from splitserve.services.frontend.beam_search import BeamSearchParams, beam_width_problem, beam_deltas, eos_token_id, \
    search_prompts
from splitserve.services.frontend.core import Delta, Frontend, SamplingRequest, new_request_id
from splitserve.services.frontend.auth import ApiKeys
from splitserve.services.frontend.errors import APIError, invalid
from splitserve.services.frontend.flow_headers import check_priority, flow_request
from splitserve.services.frontend.generation_request import GenerationRequest
from splitserve.services.frontend.limits import Rejection, check_prompt_tokens

_HTTP_TO_GRPC = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
                 429: grpc.StatusCode.RESOURCE_EXHAUSTED, 501: grpc.StatusCode.UNIMPLEMENTED,
                 503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}

_ROLES = ("system", "developer", "user", "assistant")
# Fields beam search does not use (refused when set to anything else), with their neutral values.
_UNUSED_BY_BEAMS = {"stop": None, "stop_token_ids": None, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                    "logit_bias": None, "min_tokens": 0, "structured": None}


class InferenceService(inference_pb2_grpc.InferenceServicer):
    def __init__(self, frontend: Frontend, max_prompt_tokens: int = 0, keys: ApiKeys | None = None):
        self.frontend = frontend
        self.max_prompt_tokens = max_prompt_tokens      # --max-prompt-tokens (0: the context length)
        self.keys = keys or ApiKeys()                   # a caller's key id is its flow (flow_headers.py)

    async def Generate(self, request, context):
        failure = None
        try:
            gen = self._prepare(request)
            if self.frontend.tracer is not None:      # W3C traceparent in the call's metadata
                gen.trace_context = TraceContext.from_pairs(context.invocation_metadata() or ())
            with await self._admitted(request, gen, context):
                if not request.beam_width:
                    async for delta in self.frontend.generate(gen):
                        yield _response(gen, delta, request.include_usage and delta.finish_reason is not None)
                else:
                    beams = await self._beams(request, gen)
                    for index, delta in enumerate(beams):
                        last = index == len(beams) - 1
                        response = _response(gen, delta, False, index)
                        if last and request.include_usage:
                            completion = sum(d.num_output_tokens for d in beams)
                            response.usage.CopyFrom(_usage(delta.num_prompt_tokens, completion,
                                                           delta.num_cached_tokens))
                        yield response
        except APIError as exc:
            failure = exc
        if failure is not None:
            if failure.headers:            # a shed call's reason and Retry-After
                context.set_trailing_metadata(tuple(failure.headers.items()))
            if DROPPED_REASON_HEADER in failure.headers:
                self.frontend.metrics.rejected.labels("grpc", Rejection.SHED.value).inc()
            await context.abort(_HTTP_TO_GRPC.get(failure.status, grpc.StatusCode.INTERNAL), failure.message)

    async def _admitted(self, request: inference_pb2.GenerateRequest, gen: GenerationRequest, context):
        """Flow control's Ticket for the call (held until it ends), or a no-op when flow control is
        off; raises the 429 APIError when it is shed, the 400 for bad metadata."""
        flow_control = self.frontend.flow_control
        if flow_control is None:
            return contextlib.nullcontext()
        metadata = context.invocation_metadata() or ()
        key_id = None
        if self.keys.enabled:          # the guard admitted the key already; its id names the flow
            key_id = self.keys.check_header(next((v for k, v in metadata if k == "authorization"), None))
        return await flow_control.admit(flow_request(metadata, request.priority, key_id, gen.request_id))

    async def _beams(self, request: inference_pb2.GenerateRequest, gen: GenerationRequest) -> list[Delta]:
        """The request's beam search: its beams, best first (the HTTP API's use_beam_search)."""
        for name, neutral in _UNUSED_BY_BEAMS.items():
            field = request.DESCRIPTOR.fields_by_name[name]
            is_set = request.HasField(name) if field.has_presence else bool(getattr(request, name))
            if is_set and (neutral is None or getattr(request, name) != neutral):
                raise invalid(f"{name} cannot be used with beam search: beams are ranked by the model's logprobs "
                              f"alone and end only at EOS or max_tokens", name)
        problem = beam_width_problem(request.beam_width, self.frontend.max_logprobs)
        if problem is not None:
            raise invalid(problem, "beam_width")
        params = BeamSearchParams(
            beam_width=request.beam_width, max_tokens=gen.params.max_tokens,
            length_penalty=request.length_penalty if request.HasField("length_penalty") else 1.0,
            ignore_eos=request.ignore_eos, include_stop_str_in_output=request.include_stop_str_in_output,
            num_top_logprobs=request.logprobs)
        [result] = await search_prompts(self.frontend.generate, [gen], params, eos_token_id(self.frontend.tokenizer))
        deltas = beam_deltas(result, self.frontend.tokenizer, gen.skip_special_tokens)
        if not request.HasField("logprobs"):      # as without beam search: logprobs only when asked
            for delta in deltas:
                delta.logprobs = []
        return deltas

    def _prepare(self, request: inference_pb2.GenerateRequest) -> GenerationRequest:
        fe = self.frontend
        check_priority(request.priority, fe.flow_control is not None)
        fe.check_model(request.model or fe.model_name or "")
        kind = request.WhichOneof("prompt")
        if kind == "chat":
            messages = []
            for msg in request.chat.messages:
                if msg.role not in _ROLES:
                    raise invalid(f"unknown chat role {msg.role!r}; use one of {', '.join(_ROLES)}", "chat")
                messages.append({"role": "system" if msg.role == "developer" else msg.role,
                                 "content": msg.content})
            if not messages:
                raise invalid("chat needs at least one message", "chat")
            prompt_ids = fe.chat_prompt(messages)
        elif kind == "text":
            prompt_ids = fe.text_prompt(request.text)
        elif kind == "token_ids":
            prompt_ids = fe.text_prompt(list(request.token_ids.ids))
        else:
            raise invalid("set one of text, token_ids or chat", "prompt")
        check_prompt_tokens(len(prompt_ids), self.max_prompt_tokens, "prompt")
        if request.HasField("length_penalty") and not request.beam_width:
            raise invalid("length_penalty only applies to beam search (beam_width > 0)", "length_penalty")
        if any(not s for s in request.stop):
            raise invalid("stop strings must not be empty", "stop")
        sampling = SamplingRequest(
            max_tokens=request.max_tokens if request.HasField("max_tokens") else None,
            default_max_tokens=None if kind == "chat" else 16,
            temperature=request.temperature if request.HasField("temperature") else None,
            top_p=request.top_p if request.HasField("top_p") else None,
            # proto3 cannot tell an unset top_k / min_p from 0: 0 (also "off") is unset, so the
            # model's defaults apply as they do to an HTTP request that omits them.
            top_k=request.top_k or None, min_p=request.min_p or None,
            seed=request.seed if request.HasField("seed") else None,
            stop=list(request.stop), ignore_eos=request.ignore_eos,
            logprobs=request.logprobs if request.HasField("logprobs") else None,
            logprob_token_ids=list(request.logprob_token_ids),
            presence_penalty=request.presence_penalty if request.HasField("presence_penalty") else None,
            frequency_penalty=request.frequency_penalty if request.HasField("frequency_penalty") else None,
            repetition_penalty=request.repetition_penalty if request.HasField("repetition_penalty") else None,
            logit_bias={b.token_id: b.bias for b in request.logit_bias}, min_tokens=request.min_tokens,
            stop_token_ids=list(request.stop_token_ids),
            include_stop_str_in_output=request.include_stop_str_in_output,
            structured=StructuredOutput(request.structured.kind, request.structured.spec)
            if request.HasField("structured") else None)
        params = fe.sampling_params(sampling, len(prompt_ids))
        return GenerationRequest(request.request_id or new_request_id("grpc"), "grpc", prompt_ids, params,
                                 max_tokens_from_client=sampling.caps_output)


def _response(gen: GenerationRequest, delta: Delta, with_usage: bool, index: int = 0) -> inference_pb2.GenerateResponse:
    reason = FinishReason(delta.finish_reason) if delta.finish_reason else None
    response = inference_pb2.GenerateResponse(
        request_id=gen.request_id, text=delta.text, token_ids=delta.token_ids, logprobs=delta.logprobs,
        finish_reason=finish_reason_to_proto(reason), index=index)
    if with_usage:
        response.usage.CopyFrom(_usage(delta.num_prompt_tokens, delta.num_output_tokens, delta.num_cached_tokens))
    return response


def _usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> inference_pb2.Usage:
    return inference_pb2.Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                               total_tokens=num_prompt_tokens + num_completion_tokens, cached_tokens=num_cached_tokens)
