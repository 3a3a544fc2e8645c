"""The shared block store (`splitserve kvstore`) with real worker processes: a prefix one worker
computed is fetched by another token-exact (aggregated, and by a prefill worker serving a decode
worker); a store killed in the middle of a fetch costs a recompute, never a wrong token; a store
that comes back is used again.

The workers' pools are large enough that nothing is evicted: every store hit is a block the
fetching worker never computed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import urllib.request

import grpc
import pytest

from splitserve.net import free_port
from splitserve.proto.v1 import kvstore_pb2, kvstore_pb2_grpc
from splitserve.testing.cluster import Cluster
from splitserve.testing.waiting import wait_until
from splitserve.testing.workers import generate, worker_stats

BLOCK = 16
PROMPTS = {name: [(seed * 89 + i * 11) % 1000 + 3 for i in range(5 * BLOCK + 3)]
           for seed, name in enumerate("ABC", start=1)}
STORE_GIB = 0.01


def store_stats(address: str) -> kvstore_pb2.StoreStatsResponse:
    with grpc.insecure_channel(address) as channel:
        return kvstore_pb2_grpc.KVStoreStub(channel).Stats(kvstore_pb2.StoreStatsRequest(), timeout=5)


def wait_held(address: str, blocks: int, timeout_s: float = 60.0) -> kvstore_pb2.StoreStatsResponse:
    """Publishing happens behind the engine: the store's Stats once it holds `blocks`."""
    def held() -> kvstore_pb2.StoreStatsResponse | None:
        stats = store_stats(address)
        return stats if stats.blocks_held >= blocks else None

    return wait_until(held, timeout=timeout_s, interval=0.05, what=f"the store to hold {blocks} blocks",
                      details=lambda: store_stats(address))


def tier_hits(address: str) -> dict[str, int]:
    return {t.tier: t.num_hits for t in worker_stats(address).kv_tiers}


def run(address: str, name: str, rid: str, peers=()) -> list[int]:
    return list(asyncio.run(generate(address, rid, PROMPTS[name], 6, peers)).token_ids)


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_a_prefix_computed_on_one_worker_is_fetched_by_another(llama_dir, backend):
    cluster = Cluster(llama_dir, transfer=backend)
    metrics_port = free_port()
    try:
        _, store = cluster.start_kvstore(STORE_GIB, "--transfer", backend, "--metrics-port", str(metrics_port))
        for name in ("w1", "w2"):
            cluster.start_worker(name, "both", "--kv-store", store, "--transfer", backend)
        cluster.wait_workers()
        w1, w2 = cluster.workers["w1"].address, cluster.workers["w2"].address

        front = cluster.start_frontend()                 # the kv router, following both workers' events
        front.wait_ready(2)
        want = run(w1, "A", "a1")                        # computed: nothing was anywhere
        stats = wait_held(store, 5)
        assert stats.blocks_held == 5 and stats.counters["stored"] == 5
        lookups = stats.counters["lookups"]
        assert run(w2, "A", "a2") == want                # five blocks from the store, 3 tokens computed
        # One Lookup for the admission (its second look at the same chain reuses the reply).
        assert store_stats(store).counters["lookups"] - lookups == 1
        s2 = worker_stats(w2)
        assert tier_hits(w2) == {"store": 5} and s2.num_prefix_hit_tokens == 5 * BLOCK
        assert s2.num_prompt_tokens_computed == 3
        assert store_stats(store).counters["fetched_blocks"] == 5
        # w2 published nothing it fetched: the store still holds one copy of each block.
        assert store_stats(store).counters["offered"] == 5
        # w1's KV events told the router what the store took: it credits both attached workers.
        pattern = r'splitserve_router_index_tier_blocks\{tier="store",worker="(w\d)"\} 5\.0'
        wait_until(lambda: set(re.findall(pattern, front.metrics())) == {"w1", "w2"}, timeout=10, interval=0.2,
                   what="the router to credit both workers with the store's 5 blocks", details=front.metrics)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
            exposition = reply.read().decode()
        assert "splitserve_kvstore_blocks 5.0" in exposition
        assert 'splitserve_kvstore_events_total{event="fetched_blocks"} 5.0' in exposition
    finally:
        codes = cluster.close(grace_s=30.0)
    assert codes == [0, 0, 0, 0] and not cluster.killed, cluster.outputs()[-6000:]


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_damaged_store_blocks_are_refused_both_ways_and_recomputed(llama_dir, backend):
    """The fault switch (SPLITSERVE_KV_FAULTS=store=flip, kvtransfer/faults.py) on the fetching
    worker: every block it fetches has a bit flipped before its check, which refuses it
    (store_corrupt): A is recomputed, token-exact. On a publishing worker: every block it
    publishes is flipped after its CRC was taken, and the store's own check refuses to keep it."""
    cluster = Cluster(llama_dir, transfer=backend)
    faulty = {"SPLITSERVE_KV_FAULTS": "store=flip"}
    try:
        _, store = cluster.start_kvstore(STORE_GIB, "--transfer", backend)
        cluster.start_worker("w1", "both", "--kv-store", store, "--transfer", backend)
        cluster.start_worker("w2", "both", "--kv-store", store, "--transfer", backend, env=faulty)
        cluster.start_worker("w3", "both", "--kv-store", store, "--transfer", backend, env=faulty)
        cluster.wait_workers()
        w1, w2, w3 = (cluster.workers[n].address for n in ("w1", "w2", "w3"))
        want = run(w1, "A", "a1")
        wait_held(store, 5)
        assert run(w2, "A", "a2") == want                # fetched, refused, recomputed
        s2 = worker_stats(w2)
        assert s2.kv_tier_rejections["store_corrupt"] == 5 and tier_hits(w2).get("store", 0) == 0
        assert s2.num_prompt_tokens_computed == len(PROMPTS["A"])

        run(w3, "B", "b3")                               # B's blocks are new: w3 publishes them, flipped
        wait_until(lambda: store_stats(store).counters["rejected_corrupt"] >= 5, timeout=30, interval=0.1,
                   what="the store to refuse w3's five damaged blocks", details=lambda: store_stats(store))
        assert store_stats(store).blocks_held == 5       # A's, from w1; none of B's
        assert run(w1, "B", "b1") == run(w3, "B", "b3-again")
    finally:
        codes = cluster.close(grace_s=30.0)
    assert not cluster.killed, cluster.outputs()[-6000:]
    assert codes == [0] * len(codes), cluster.outputs()[-6000:]
    assert sum("KV faults: injecting store=flip" in line for line in cluster.outputs().splitlines()) >= 10


def test_a_store_killed_mid_fetch_costs_a_recompute_not_a_token(llama_dir):
    cluster = Cluster(llama_dir, transfer="tcp")
    try:
        proc, store = cluster.start_kvstore(STORE_GIB, "--transfer", "tcp", "--fault-fetch-delay", "60")
        port = int(store.rsplit(":", 1)[1])
        for name in ("w1", "w2"):
            cluster.start_worker(name, "both", "--kv-store", store, "--transfer", "tcp")
        cluster.wait_workers()
        w1, w2 = cluster.workers["w1"].address, cluster.workers["w2"].address
        want_a, want_b = run(w1, "A", "a1"), run(w1, "B", "b1")
        assert wait_held(store, 10).blocks_held == 10

        async def killed_during_fetch() -> list[int]:
            request = asyncio.ensure_future(generate(w2, "a2", PROMPTS["A"], 6))
            await asyncio.to_thread(proc.wait_for_line, r"kvstore: fetch .* blocks pinned", 30)
            proc.process.kill()                          # its blocks are pinned, none written yet
            return list((await request).token_ids)

        assert asyncio.run(killed_during_fetch()) == want_a
        s2 = worker_stats(w2)
        assert dict(s2.kv_tier_rejections) == {"store_unavailable": 5}
        assert s2.num_prompt_tokens_computed == len(PROMPTS["A"]) and tier_hits(w2) == {"store": 0}

        # The store comes back empty on the same port. w1's next publish finds it does not know
        # w1, attaches again and publishes. w2 attaches again on a lookup once its back-off (1 s,
        # longer after more failures) is over: poke it with short prompts until the store has seen
        # both. (w2 itself has measured this tiny model's prefill by now, and its fetch rule rightly
        # recomputes 5 blocks rather than fetch them; a worker that has measured nothing fetches.)
        cluster.start_kvstore(STORE_GIB, "--transfer", "tcp", port=port)
        want_c = run(w1, "C", "c1")
        assert wait_held(store, 5).blocks_held == 5
        pokes: list[int] = []

        def attached_both() -> bool:
            if store_stats(store).counters["attached"] >= 2:
                return True
            pokes.append(len(pokes) + 1)
            asyncio.run(generate(w2, f"poke-{pokes[-1]}", [7 + pokes[-1]] * (BLOCK + 1), 1))
            return False

        # Half a second between pokes: w2 looks up again once its back-off is over, not at each poke.
        wait_until(attached_both, timeout=60, interval=0.5, what="w2 to attach to the new store",
                   details=lambda: cluster.outputs()[-3000:])
        poke = len(pokes)
        assert run(w2, "B", "b2") == want_b              # the old store's blocks are gone: computed
        assert worker_stats(w2).num_prompt_tokens_computed == 2 * len(PROMPTS["A"]) + poke * (BLOCK + 1)
        w3 = cluster.start_worker("w3", "both", "--kv-store", store, "--transfer", "tcp")
        w3.wait_ready()
        assert run(w3.address, "C", "c3") == want_c and tier_hits(w3.address) == {"store": 5}
    finally:
        cluster.close(grace_s=30.0)
    assert not cluster.killed, cluster.outputs()[-6000:]


def test_a_prefill_worker_fetches_from_the_store_for_a_decode_worker(llama_dir):
    cluster = Cluster(llama_dir, transfer="tcp")
    try:
        _, store = cluster.start_kvstore(STORE_GIB, "--transfer", "tcp")
        cluster.start_worker("w1", "both", "--kv-store", store, "--transfer", "tcp")
        cluster.start_worker("p0", "prefill", "--kv-store", store)
        cluster.start_worker("d0", "decode", "--remote-prefill-threshold", "8")
        cluster.wait_workers()
        w1, p0, d0 = (cluster.workers[n].address for n in ("w1", "p0", "d0"))
        want = run(w1, "A", "a1")
        assert wait_held(store, 5).blocks_held == 5
        reply = asyncio.run(generate(d0, "a2", PROMPTS["A"], 6, [("p0", p0)]))
        assert reply.prefilled_remotely and list(reply.token_ids) == want
        assert tier_hits(p0) == {"store": 5}
        assert worker_stats(p0).num_prompt_tokens_computed == 3
    finally:
        codes = cluster.close(grace_s=30.0)
    assert codes == [0, 0, 0, 0] and not cluster.killed, cluster.outputs()[-6000:]


def _complete(base: str, prompt: list[int]) -> tuple[str, int]:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        data = json.load(reply)
    return data["choices"][0]["text"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def _kvstore_pid(pids: list[int]) -> int:
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"\0kvstore\0" in f.read():
                return pid
    raise AssertionError("serve started no kvstore")


def test_serve_starts_a_store_its_workers_share_and_restarts_it(llama_dir):
    """Through `splitserve serve`: round-robin sends a prompt's second request to the other
    worker, which fetches the prefix the first computed; the store is killed, `serve` starts it
    again on its port, and the workers use the new one (they attach again on their own)."""
    from .conftest import start_serve, stop_serve

    server = start_serve(str(llama_dir), "--kv-store-gib", str(STORE_GIB), "--router", "round-robin",
                         "--transfer", "tcp", "--served-model-name", "m", num_workers=2)
    try:
        store = re.search(r"kvstore ready at (\S+)", server.proc.output).group(1)
        text, cached = _complete(server.base_url, PROMPTS["A"])
        assert cached == 0 and wait_held(store, 5).blocks_held == 5
        assert _complete(server.base_url, PROMPTS["A"]) == (text, 5 * BLOCK)     # the other worker, from the store

        os.kill(_kvstore_pid(server.proc.children()), signal.SIGKILL)

        def new_store_answers() -> bool:
            try:
                return store_stats(store).counters["lookups"] == 0
            except grpc.RpcError:
                return False

        wait_until(new_store_answers, timeout=30, interval=0.2, what="serve's new store to answer",
                   details=lambda: server.proc.output)
        text_c, cached = _complete(server.base_url, PROMPTS["C"])
        assert cached == 0 and wait_held(store, 5).blocks_held == 5
        assert _complete(server.base_url, PROMPTS["C"]) == (text_c, 5 * BLOCK)
    finally:
        stop_serve(server)


def test_workers_find_the_store_in_etcd(llama_dir, tmp_path):
    """`kvstore --etcd` registers itself; workers started with `--kv-store etcd` look it up there."""
    from splitserve.testing.etcd import Etcd

    etcd = Etcd(str(tmp_path / "etcd"))
    etcd.start()
    cluster = Cluster(llama_dir, transfer="tcp")
    try:
        _, store = cluster.start_kvstore(STORE_GIB, "--transfer", "tcp", "--etcd", etcd.endpoint)
        for name in ("w1", "w2"):
            cluster.start_worker(name, "both", "--kv-store", "etcd", "--etcd", etcd.endpoint, "--transfer", "tcp")
        cluster.wait_workers()
        w1, w2 = cluster.workers["w1"].address, cluster.workers["w2"].address
        want = run(w1, "A", "a1")
        assert wait_held(store, 5).blocks_held == 5
        assert run(w2, "A", "a2") == want and tier_hits(w2) == {"store": 5}
    finally:
        codes = cluster.close(grace_s=30.0)
        etcd.stop()
    assert codes == [0, 0, 0] and not cluster.killed, cluster.outputs()[-6000:]
