"""A worker's spans of one request (splitserve/tracing.py), made only when the worker traces.

Decode (or aggregated) worker, below the frontend's `worker_call` (TokenGenerateRequest.trace_context):

    generate (server)
    ├── queue            a remote prefill waiting for free KV blocks (remote_prefill.py)
    ├── remote_prefill   (client) one per prefill worker tried; its context goes in PrefillRequest
    ├── prefill          a local prefill: queued in the engine until the first token
    └── decode           from the first token to the last

Prefill worker, below the decode worker's `remote_prefill` (PrefillRequest.trace_context):

    prefill (server)
    └── kv_transfer      the KV pushed layer by layer into the decode worker's blocks, until the
                         completion notification is flushed (prefill_server.py)

`GenerateTrace` follows one Generate request through its outputs; `prefill_span` opens the
prefill worker's span. The service holds no tracer when tracing is off, and then none of
this runs.
"""

from __future__ import annotations

from splitserve.proto.v1 import worker_pb2
from splitserve.services.worker_protocol.outputs import RequestOutput
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.tracing import GenAI, TraceContext, Tracer


def request_attributes(request_id: str, worker_id: str, params: SamplingParams, num_prompt_tokens: int) -> dict:
    return {GenAI.REQUEST_ID: request_id, "splitserve.worker.id": worker_id,
            GenAI.REQUEST_MAX_TOKENS: params.max_tokens, GenAI.REQUEST_TEMPERATURE: params.temperature,
            GenAI.REQUEST_TOP_P: params.top_p, GenAI.USAGE_INPUT_TOKENS: num_prompt_tokens}


class GenerateTrace:
    """The spans of one Generate request on a decode or aggregated worker."""

    def __init__(self, tracer: Tracer, worker_id: str, request_id: str, request: worker_pb2.TokenGenerateRequest,
                 params: SamplingParams) -> None:
        self.tracer = tracer
        attributes = request_attributes(request_id, worker_id, params, len(request.token_ids))
        attributes[GenAI.REQUEST_N] = max(1, request.n)
        self.span = tracer.start_span("generate", TraceContext.from_proto(request.trace_context), "server",
                                      attributes)
        self._phase = None           # prefill (local) until the first token, then decode
        self._decoding = False
        self._num_output_tokens = 0
        self._finish_reasons: list[str] = []

    def prefilling_locally(self) -> None:
        self.span.set_attribute("splitserve.prefill.remote", False)
        self._phase = self.tracer.start_span("prefill", self.span)

    def prefilled_remotely(self) -> None:
        self.span.set_attribute("splitserve.prefill.remote", True)

    def observe(self, out: RequestOutput) -> None:
        """One engine output: the first ends the prefill and starts the decode."""
        if not self._decoding and out.new_token_ids:
            if self._phase is not None:
                self._phase.set_attribute("splitserve.num_cached_tokens", out.num_cached_tokens)
                self._phase.end()
            self._phase = self.tracer.start_span("decode", self.span)
            self._decoding = True
            self.span.set_attribute("splitserve.num_cached_tokens", out.num_cached_tokens)
        if out.finished:
            self._num_output_tokens += out.num_output_tokens
            if out.finish_reason is not None:
                self._finish_reasons.append(out.finish_reason.value)

    def end(self, error: BaseException | None) -> None:
        attributes = {GenAI.USAGE_OUTPUT_TOKENS: self._num_output_tokens}
        if self._finish_reasons:
            attributes[GenAI.RESPONSE_FINISH_REASONS] = self._finish_reasons
        self.span.set_attributes(attributes)
        if self._phase is not None:
            self._phase.set_attribute(GenAI.USAGE_OUTPUT_TOKENS, self._num_output_tokens)
            if error is not None:
                self.tracer.fail(self._phase, error)
            self._phase.end()
        if error is not None:
            self.tracer.fail(self.span, error)
        self.span.end()


def prefill_span(tracer: Tracer, worker_id: str, request: worker_pb2.PrefillRequest, params: SamplingParams):
    """The prefill worker's span of one Prefill call, below the decode worker's `remote_prefill`."""
    attributes = request_attributes(request.request_id, worker_id, params, len(request.token_ids))
    return tracer.start_span("prefill", TraceContext.from_proto(request.trace_context), "server", attributes)
