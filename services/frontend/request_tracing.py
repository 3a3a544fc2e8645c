"""One request's spans in the frontend (splitserve/tracing.py), made only when the frontend traces.

    llm_request (server; the client's traceparent is its parent)
    ├── route            one per routing: the decision's workers, policy and cost terms
    ├── worker_call      (client) one per worker call; its context goes to the decode worker in
    │                    TokenGenerateRequest.trace_context, so the workers' spans hang below it
    └── migration        from a broken stream to the route that continues it (migration.py)

`llm_request` is vLLM's span name and carries its attributes and the GenAI semantic
conventions' (usage equals the response's usage). `Frontend.generate` (core.py) holds a
`RequestTrace` only when it has a tracer, so a frontend without one does nothing here.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable

from splitserve.proto.v1 import worker_pb2
from splitserve.router.policies.base import Decision
from splitserve.tracing import GenAI, Tracer

from splitserve.services.frontend.generation_request import GenerationRequest
from splitserve.services.frontend.migration import Progress
from splitserve.services.frontend.routing import Route

# The API → gen_ai.operation.name (the public gRPC API takes a prompt, as completions do).
OPERATIONS = {"chat": "chat", "responses": "chat", "completions": "text_completion", "grpc": "text_completion"}


class RequestTrace:
    """The spans of one `Frontend.generate` call."""

    def __init__(self, tracer: Tracer, req: GenerationRequest, model: str | None) -> None:
        self.tracer = tracer
        self.req = req
        p = req.params
        attributes = {GenAI.REQUEST_ID: req.request_id, GenAI.OPERATION_NAME: OPERATIONS.get(req.api, req.api),
                      GenAI.REQUEST_MAX_TOKENS: p.max_tokens, GenAI.REQUEST_TEMPERATURE: p.temperature,
                      GenAI.REQUEST_TOP_P: p.top_p, GenAI.REQUEST_TOP_K: p.top_k, GenAI.REQUEST_N: 1,
                      GenAI.USAGE_INPUT_TOKENS: len(req.prompt_ids)}
        if model:
            attributes[GenAI.REQUEST_MODEL] = attributes[GenAI.RESPONSE_MODEL] = model
        if p.seed is not None:
            attributes[GenAI.REQUEST_SEED] = p.seed
        self.span = tracer.start_span("llm_request", req.trace_context, "server", attributes)
        self._migration = None

    async def route(self, routing: Awaitable[Route]) -> Route:
        """Await `routing` inside a `route` span; it also ends a migration's span."""
        span = self.tracer.start_span("route", self.span)
        try:
            route = await routing
            span.set_attributes(_route_attributes(route))
            return route
        except BaseException as exc:
            self.tracer.fail(span, exc)
            raise
        finally:
            span.end()
            self._end_migration()

    def start_call(self, message: worker_pb2.TokenGenerateRequest, route: Route):
        """The span of one worker call; `message` carries it to the decode worker."""
        attributes = {"splitserve.worker.id": route.decode.worker_id, "splitserve.attempt.id": message.request_id,
                      "splitserve.attempt.num_prompt_tokens": len(message.token_ids)}
        if route.prefill is not None:
            attributes["splitserve.prefill_worker.id"] = route.prefill.worker_id
        span = self.tracer.start_span("worker_call", self.span, "client", attributes)
        self.carry(message, span)
        return span

    def carry(self, message: worker_pb2.TokenGenerateRequest, span=None) -> None:
        """Set `message`'s trace context to `span` (default: the request's span)."""
        context = self.tracer.context_of(span if span is not None else self.span)
        message.trace_context.traceparent = context.traceparent
        message.trace_context.tracestate = context.tracestate

    def end_call(self, span, broken: str) -> None:
        if broken:
            self.tracer.fail(span, broken)
        span.end()

    def migrating(self, progress: Progress, worker_id: str, broken: str) -> None:
        """The stream from `worker_id` broke and the request moves on: a span until its next route."""
        self._migration = self.tracer.start_span("migration", self.span, attributes={
            "splitserve.migration.from_worker_id": worker_id, "splitserve.migration.reason": broken,
            "splitserve.migration.attempt": progress.num_migrations,
            "splitserve.migration.num_forwarded_tokens": progress.num_output_tokens})

    def _end_migration(self) -> None:
        if self._migration is not None:
            self._migration.end()
            self._migration = None

    def finish(self, progress: Progress, finish_reason: str | None, first_token_at: float | None,
               error: BaseException | None) -> None:
        now = time.monotonic()
        span = self.span
        span.set_attributes({GenAI.USAGE_OUTPUT_TOKENS: progress.num_output_tokens,
                             GenAI.USAGE_PROMPT_TOKENS: len(self.req.prompt_ids),
                             GenAI.USAGE_COMPLETION_TOKENS: progress.num_output_tokens,
                             GenAI.LATENCY_E2E: now - self.req.arrival,
                             "splitserve.migrations": progress.num_migrations})
        if first_token_at is not None:
            span.set_attribute(GenAI.LATENCY_TIME_TO_FIRST_TOKEN, first_token_at - self.req.arrival)
        if finish_reason is not None:
            span.set_attribute(GenAI.RESPONSE_FINISH_REASONS, [finish_reason])
        if error is not None:
            self.tracer.fail(span, error)
        self._end_migration()
        span.end()


def _route_attributes(route: Route) -> dict[str, object]:
    if route.decision is None:        # a router that gives no reasons
        return {"splitserve.route.decode.worker_id": route.decode.worker_id}
    attributes = _decision_attributes("splitserve.route.decode", route.decision.decode)
    if route.decision.prefill is not None:
        attributes.update(_decision_attributes("splitserve.route.prefill", route.decision.prefill))
    attributes["splitserve.route.reason"] = route.decision.reason
    return attributes


def _decision_attributes(prefix: str, decision: Decision) -> dict[str, object]:
    """A leg's decision: the policy, the winner's cost terms and the runner-up's cost."""
    winner, c = decision.winner, decision.winner.candidate
    attributes = {f"{prefix}.policy": decision.policy, f"{prefix}.worker_id": winner.worker_id,
                  f"{prefix}.cost": float(winner.cost), f"{prefix}.overlap_blocks": c.overlap_blocks,
                  f"{prefix}.uncached_blocks": winner.uncached_blocks,
                  f"{prefix}.pending_prefill_blocks": c.pending_prefill_blocks,
                  f"{prefix}.decode_blocks": c.decode_blocks, f"{prefix}.cached_blocks": c.cached_blocks}
    if decision.runner_up is not None:
        attributes[f"{prefix}.runner_up.worker_id"] = decision.runner_up.worker_id
        attributes[f"{prefix}.runner_up.cost"] = float(decision.runner_up.cost)
    return attributes
