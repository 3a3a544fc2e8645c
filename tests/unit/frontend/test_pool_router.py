"""The router adapter: RouterCore decisions come back as the pool's own handles, `exclude` honoured.

Routers are built as the frontend server builds them (`build_router`); the
workers are handles that have described themselves, no sockets.
"""

from __future__ import annotations

from splitserve.proto.v1 import worker_pb2
from splitserve.block_hashes import block_hashes
from splitserve.services.frontend.routing import RouteRequest, build_router
from splitserve.services.frontend.workers.pool import WorkerHandle, WorkerPool

PROMPT = list(range(100, 164))          # 4 blocks of 16


def _handle(name: str, role: str, ready: bool = True) -> WorkerHandle:
    info = worker_pb2.DescribeResponse(worker_id=name, max_model_len=1000, block_size=16)
    return WorkerHandle(name, role, f"{name}:1", channel=None, stub=None, ready=ready, info=info)


def _pool() -> tuple[WorkerPool, dict[str, WorkerHandle]]:
    handles = {n: _handle(n, r) for n, r in [("d0", "decode"), ("d1", "decode"), ("p0", "prefill"),
                                             ("p1", "prefill")]}
    handles["d2"] = _handle("d2", "decode", ready=False)
    return WorkerPool(handles.values()), handles


def test_kv_decisions_map_onto_the_pools_handles():
    pool, h = _pool()
    router = build_router(pool, "kv", remote_prefill_threshold=16)
    router.core.index.stored("d1", block_hashes(PROMPT, 16))
    router.core.index.stored("p1", block_hashes(PROMPT[:32], 16))
    route = router.route(RouteRequest("r1", PROMPT + [7] * 40))     # 40 tokens uncached on d1: remote
    assert route.decode is h["d1"] and route.prefill is h["p1"]
    assert "remote prefill" in str(route.reason) and "kv" in str(route.reason)
    short = router.route(RouteRequest("r2", PROMPT + [8]))           # 1 token uncached: local prefill
    assert short.decode is h["d1"] and short.prefill is None
    assert "local prefill" in str(short.reason)


def test_exclude_is_honoured_on_each_leg():
    pool, h = _pool()
    prompt = PROMPT + [9] * 40

    def route(exclude: set[str]):
        # A fresh router each time: a decision predicts the prompt on its winners.
        router = build_router(pool, "kv", remote_prefill_threshold=16)
        router.core.index.stored("d1", block_hashes(PROMPT, 16))
        router.core.index.stored("p1", block_hashes(PROMPT, 16))
        return router.route(RouteRequest("r", prompt), exclude=frozenset(exclude))

    assert (route(set()).decode, route(set()).prefill) == (h["d1"], h["p1"])
    r = route({"d1"})
    assert r.decode is h["d0"] and r.prefill is h["p1"]
    r = route({"p1"})
    assert r.decode is h["d1"] and r.prefill is h["p0"]
    r = route({"p0", "p1"})
    assert r.decode is h["d1"] and r.prefill is None and str(r.reason).endswith("aggregated")
    # d2 is not ready: with d0 and d1 excluded no decode worker is left.
    assert route({"d0", "d1"}) is None


def test_the_load_hooks_reach_the_core():
    pool, h = _pool()
    router = build_router(pool, "least-loaded")
    route = router.route(RouteRequest("r1", PROMPT))
    assert router.core.load.num_requests() == 1
    router.on_first_token("r1")
    assert router.core.load.decode_blocks(route.decode.worker_id) == 4
    router.on_finished("r1")
    assert router.core.load.num_requests() == 0 and router.core.load.decode_blocks(route.decode.worker_id) == 0


def test_a_decode_worker_gets_only_prefill_workers_of_its_kv_layout():
    """Describe's kv_transfer_layout: a vLLM decode worker's paged buffer cannot take a built-in
    prefill worker's blocks (the handshake would refuse), so the router does not pair them."""
    pool, h = _pool()
    for name, layout in (("d0", "paged"), ("d1", "paged"), ("p0", "layer-major"), ("p1", "paged")):
        h[name].info.kv_transfer_layout = layout
    router = build_router(pool, "kv", remote_prefill_threshold=16)
    router.core.index.stored("p0", block_hashes(PROMPT, 16))         # p0 holds the prompt: kv would pick it
    route = router.route(RouteRequest("r", PROMPT + [5] * 40))
    assert route.prefill is h["p1"]
    h["p1"].info.kv_transfer_layout = "layer-major"
    route = router.route(RouteRequest("r2", PROMPT + [6] * 40))
    assert route.prefill is None and "no prefill worker of its KV layout" in str(route.reason)
    h["p0"].info.kv_transfer_layout = ""                               # a worker from before the field
    assert router.route(RouteRequest("r3", PROMPT + [4] * 40)).prefill is h["p0"]


def test_a_rolling_updates_old_and_new_workers_are_never_paired():
    """Describe's fingerprint (weights, tokenizer, engine): two revisions of one model under one
    name have equal layouts but never exchange KV, whichever connector would move it."""
    pool, h = _pool()
    old, new = "weights=aaaa tokenizer=t engine=builtin/0.1.0", "weights=bbbb tokenizer=t engine=builtin/0.1.0"
    for name, fingerprint in (("d0", new), ("d1", new), ("p0", old), ("p1", new)):
        h[name].info.kv_transfer_layout = "layer-major"
        h[name].info.fingerprint = fingerprint
    router = build_router(pool, "kv", remote_prefill_threshold=16)
    router.core.index.stored("p0", block_hashes(PROMPT, 16))         # the old p0 holds the prompt
    assert router.route(RouteRequest("r", PROMPT + [5] * 40)).prefill is h["p1"]
    h["p1"].info.fingerprint = old
    route = router.route(RouteRequest("r2", PROMPT + [6] * 40))
    assert route.prefill is None
    h["p0"].info.fingerprint = ""                                      # a worker from before the field
    assert router.route(RouteRequest("r3", PROMPT + [4] * 40)).prefill is h["p0"]
