"""What the endpoint picker decides for one request: the decode endpoint(s) and the prefill worker.

The body is parsed and tokenized by the frontend's own request preparation
(`GenerationEndpoints.prepare_*`: the same models, chat template, limits and refusals), so the
prompt the router scores is, token for token, the one the model server will run, and a request
the model server would refuse with a 4xx is refused here, before it costs a worker anything. The
router is the frontend's `PoolRouter` (KV overlap against load, prefill pairing); its decision
maps back to endpoints through the `EndpointBook`. The proxy's subset hint excludes every other
decode worker (none left: 503, as the protocol asks).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from splitserve.services.frontend.core import Frontend
from splitserve.services.frontend.errors import APIError
from splitserve.services.frontend.http.generation import GenerationEndpoints
from splitserve.services.frontend.routing import PoolRouter, RouteRequest
from splitserve.services.frontend.workers.pool import WorkerHandle

from splitserve.services.epp.endpoints import EndpointBook

NO_ENDPOINT = "no model server is ready to take the request"


@dataclass(slots=True, frozen=True)
class Parsed:
    """A request as the picker needs it: the prompt the router scores, and its priority."""

    token_ids: list[int]
    cache_salt: str = ""
    priority: int = 0        # the body's `priority` (vLLM's: lower first), for flow control


@dataclass(slots=True, frozen=True)
class Pick:
    request_id: str          # the router's booking: credited on first token and completion
    endpoints: list[str]     # HTTP host:port, the primary first, then fallbacks
    prefill: str             # the prefill worker's gRPC host:port, or "" (prefill where it decodes)
    worker_id: str           # the decode worker's id (logs, metrics)


class EndpointPicker:
    def __init__(self, frontend: Frontend, router: PoolRouter, endpoints: EndpointBook, fallbacks: int = 0,
                 max_prompt_tokens: int = 0):
        self.frontend = frontend
        self.router = router
        self.endpoints = endpoints
        self.fallbacks = fallbacks
        self.requests = GenerationEndpoints(None, frontend, max_prompt_tokens)

    def parse(self, path: str, body: bytes | None) -> Parsed:
        """The prompt of one request (`body` None: it has none, e.g. a GET: nothing to score); the
        model server's own APIError (4xx) for a request it would refuse."""
        prepare = self.requests.routes.get(path.partition("?")[0])
        if prepare is None or body is None:
            return Parsed([])
        prepared = prepare(body)
        return Parsed(prepared.gen.prompt_ids, prepared.gen.params.cache_salt, prepared.priority)

    def pick(self, path: str, body: bytes | None, subset: frozenset[str] | None = None) -> Pick:
        """Parse and route one request; an APIError (4xx/503) to answer."""
        return self.route(self.parse(path, body), subset)

    def route(self, parsed: Parsed, subset: frozenset[str] | None = None) -> Pick:
        """The endpoints (and prefill worker) for a parsed request; an APIError (503) when none is ready."""
        decoders = self.frontend.pool.ready("decode")
        allowed = [w for w in decoders if subset is None or self.endpoints.endpoint(w.address) in subset]
        if not allowed:
            reason = NO_ENDPOINT if not decoders or subset is None else \
                f"none of the {len(subset)} endpoints the gateway allows (subset hint) is a ready model server"
            raise APIError(503, reason, type="service_unavailable")
        exclude = frozenset(w.worker_id for w in decoders if w not in allowed)
        request_id = f"epp-{uuid.uuid4().hex}"
        route = self.router.route(RouteRequest(request_id, parsed.token_ids, parsed.cache_salt), exclude)
        if route is None:
            raise APIError(503, NO_ENDPOINT, type="service_unavailable")
        endpoints = [self.endpoints.endpoint(route.decode.address)]
        endpoints += self._fallbacks(route.decode, allowed, route.decision)
        prefill = route.prefill.address if route.prefill is not None else ""
        return Pick(request_id, endpoints, prefill, route.decode.worker_id)

    def _fallbacks(self, chosen: WorkerHandle, allowed: list[WorkerHandle], decision) -> list[str]:
        """Up to `fallbacks` other endpoints: the decision's runner-up first, then the least loaded."""
        if self.fallbacks <= 0:
            return []
        runner_up = decision.decode.runner_up.worker_id if decision is not None and decision.decode.runner_up else None
        load = self.router.core.load
        others = sorted((w for w in allowed if w is not chosen),
                        key=lambda w: (w.worker_id != runner_up, load.decode_blocks(w.worker_id),
                                       load.pending_prefill_tokens(w.worker_id), w.worker_id))
        return [self.endpoints.endpoint(w.address) for w in others[:self.fallbacks]]

    def credit_first_token(self, pick: Pick) -> None:
        self.router.on_first_token(pick.request_id)

    def credit_finished(self, pick: Pick) -> None:
        self.router.on_finished(pick.request_id)
