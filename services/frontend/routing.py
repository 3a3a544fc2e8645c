"""Which workers serve a request: the `Router` interface, and `RouterCore` decisions as worker handles.

A router picks a decode-capable worker (role decode or both) and, when the
deployment has a prefill pool, a prefill worker; the decode worker decides by
itself whether the prompt is worth sending there (conditional disaggregation).

`PoolRouter` is the frontend's only router. It only decides: it hands the
pool's ready workers' ids to a `RouterCore` (splitserve.router: index, load,
one policy per leg) and maps the decision back onto the pool's handles. The
pool owns membership (workers/pool.py); the KV events and Stats that keep
the core's view current are `RouterFeeds` (router_feeds.py), which
`start()`/`close()` run. `build_router` makes one from the CLI's policy
names; the server and the tests both build routers with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from splitserve.router.core import RouteDecision, RouterCore
from splitserve.router.policies import DEFAULT_PREFILL_WEIGHT

from splitserve.services.frontend.router_feeds import RouterFeeds
from splitserve.services.frontend.workers.pool import WorkerHandle, WorkerPool


@dataclass(slots=True, frozen=True)
class RouteRequest:
    request_id: str
    token_ids: list[int]
    cache_salt: str = ""        # the worker salts its block hashes with it: so does the router


@dataclass(slots=True, frozen=True)
class Route:
    decode: WorkerHandle
    prefill: WorkerHandle | None
    reason: object          # str() says why: formatted only when it is logged
    decision: RouteDecision | None = None     # the scores behind it (the trace's route span)


class Router(Protocol):
    def route(self, request: RouteRequest, exclude: frozenset[str] = frozenset()) -> Route | None:
        """Pick workers for `request`, avoiding worker ids in `exclude`; None when no
        decode-capable worker is ready."""

    def on_first_token(self, request_id: str) -> None:
        """The request's prefill is over (load accounting)."""

    def on_finished(self, request_id: str) -> None:
        """The request ended, however it ended."""


class PoolRouter:
    """A `RouterCore` over a `WorkerPool`'s ready workers."""

    def __init__(self, pool: WorkerPool, core: RouterCore, feeds: RouterFeeds | None = None):
        self.pool = pool
        self.core = core
        self.feeds = feeds if feeds is not None else RouterFeeds(pool, core)

    def route(self, request: RouteRequest, exclude: frozenset[str] = frozenset()) -> Route | None:
        decoders = {w.worker_id: w for w in self.pool.ready("decode") if w.worker_id not in exclude}
        prefillers = {w.worker_id: w for w in self.pool.ready("prefill") if w.worker_id not in exclude}
        decision = self.core.route(request.request_id, request.token_ids, list(decoders), list(prefillers),
                                   request.cache_salt, lambda d, p: same_kv_layout(decoders[d], prefillers[p]))
        if decision is None:
            return None
        prefill = prefillers[decision.prefill.winner.worker_id] if decision.prefill else None
        return Route(decoders[decision.decode.winner.worker_id], prefill, _Explanation(decision), decision)

    def on_first_token(self, request_id: str) -> None:
        self.core.on_first_token(request_id)

    def on_finished(self, request_id: str) -> None:
        self.core.on_finished(request_id)

    def start(self) -> None:
        """Start the feeds (needs a running loop; routing works without them, on load alone)."""
        self.feeds.start()

    async def close(self) -> None:
        await self.feeds.close()


def same_kv_layout(decode: WorkerHandle, prefill: WorkerHandle) -> bool:
    """Whether `prefill` can fill `decode`'s blocks: the same KV transfer layout and the same
    fingerprint (weights, tokenizer, engine: a rolling update's old and new workers never pair).
    A worker from before Describe said one, or not yet described, is taken as compatible on that
    count: its handshake still refuses."""
    return all(not d or not p or d == p for d, p in (
        (_described(decode, "kv_transfer_layout"), _described(prefill, "kv_transfer_layout")),
        (_described(decode, "fingerprint"), _described(prefill, "fingerprint"))))


def _described(worker: WorkerHandle, field: str) -> str:
    return getattr(worker.info, field) if worker.info is not None else ""


def build_router(pool: WorkerPool, policy: str = "kv", prefill_policy: str | None = None, seed: int | None = None,
                 prefill_weight: float = DEFAULT_PREFILL_WEIGHT, temperature: float = 0.0,
                 remote_prefill_threshold: int = 64, metrics_registry=None,
                 tier_credit: dict[str, float] | None = None) -> PoolRouter:
    """A PoolRouter for the CLI names (kv, round-robin, random, least-loaded, power-of-two);
    ValueError for an unknown one.

    KV events are subscribed to, and routed prompts predicted in the index, only when a leg
    uses `kv` (the other policies never read the index).
    """
    from splitserve.router.metrics import RouterMetrics
    from splitserve.router.policies import make_policy

    prefill_policy = prefill_policy or policy
    uses_index = "kv" in (policy, prefill_policy)
    core = RouterCore(make_policy(policy, seed, prefill_weight, temperature),
                      make_policy(prefill_policy, None if seed is None else seed + 1, prefill_weight, temperature),
                      remote_prefill_threshold=remote_prefill_threshold,
                      metrics=RouterMetrics(metrics_registry), predict=uses_index, tier_credit=tier_credit)
    return PoolRouter(pool, core, RouterFeeds(pool, core, subscribe=uses_index))


@dataclass(slots=True, frozen=True)
class _Explanation:
    """A decision's reason for the request log, formatted only if the line is written."""

    decision: RouteDecision

    def __str__(self) -> str:
        return f"{self.decision.decode.explain()}; {self.decision.reason}"
