"""KV tiers in a real `splitserve worker`: blocks its pool evicts come back from the host and disk
tiers token-exact, a corrupted block file on disk is recomputed (never used), and the Stats RPC
and /metrics report each tier.

The worker's pool holds one request (6 blocks of 16 tokens); its host tier holds one block, so
of the 5 full blocks of prompt A that prompt B evicts, the last lands in the host tier and the
first four go on to the disk (the host tier's LRU victims).
"""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from splitserve.net import free_port
from splitserve.testing.cluster import Cluster
from splitserve.testing.waiting import wait_until
from splitserve.testing.workers import generate, worker_stats

BLOCK = 16
PROMPTS = {name: [(seed * 97 + i * 13) % 1000 + 3 for i in range(5 * BLOCK + 3)]
           for seed, name in enumerate("AB", start=1)}
BLOCK_BYTES = 32768                       # the random Llama of tests/conftest.py: 2 layers, K and V, fp32
GIB = 1 << 30


def _metrics(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _wait_files(disk: Path, num_files: int) -> None:
    wait_until(lambda: len(list(disk.glob("*.kvb"))) >= num_files, timeout=10, interval=0.05,
               what=f"{num_files} block files on the disk tier", details=lambda: sorted(disk.glob("*.kvb")))


def test_tiers_in_a_worker_process(llama_dir, tmp_path):
    cluster = Cluster(llama_dir, transfer="tcp")
    metrics_port = free_port()
    disk = tmp_path / "kv"
    try:
        cluster.start_worker("w", "both", "--kv-cache-gib", str(6.5 * BLOCK_BYTES / GIB),
                             "--kv-host-gib", str(1.5 * BLOCK_BYTES / GIB), "--kv-disk-gib", "0.01",
                             "--kv-disk-path", str(disk), "--metrics-port", str(metrics_port))
        cluster.wait_workers()
        address = cluster.workers["w"].address

        def run(name: str, rid: str) -> list[int]:
            return list(asyncio.run(generate(address, rid, PROMPTS[name], 6)).token_ids)

        want_a, want_b = run("A", "a1"), run("B", "b1")            # B evicts A's five blocks below
        stats = worker_stats(address)
        tiers = {t.tier: t for t in stats.kv_tiers}
        assert tiers["host"].capacity_blocks == 1 and tiers["host"].num_blocks == 1
        assert tiers["disk"].num_written == 4

        _wait_files(disk, 4)                                        # the disk tier writes behind the engine
        assert len(list(disk.glob("*.kvb"))) == 4
        assert run("A", "a2") == want_a                             # its prefix back from both tiers
        stats = worker_stats(address)
        tiers = {t.tier: t for t in stats.kv_tiers}
        assert tiers["host"].num_hits == 1 and tiers["disk"].num_hits == 4
        assert stats.num_prefix_hit_tokens == 5 * BLOCK

        # A's admission evicted B's blocks; the host slot was A's (being loaded), so all five went
        # to disk. Damage every block file there: B is recomputed from its first block, not read wrong.
        _wait_files(disk, 9)
        for f in disk.glob("*.kvb"):
            data = bytearray(f.read_bytes())
            data[-1] ^= 0xFF
            f.write_bytes(bytes(data))
        assert run("B", "b2") == want_b
        stats = worker_stats(address)
        assert dict(stats.kv_tier_rejections) == {"corrupt": 1}
        assert {t.tier: t.num_hits for t in stats.kv_tiers} == {"host": 1, "disk": 4}

        samples = _metrics(f"http://127.0.0.1:{metrics_port}/metrics")
        labels = {("worker", "w"), ("role", "both")}
        assert samples[("splitserve_worker_kv_tier_hits_total", frozenset(labels | {("tier", "disk")}))] == 4
        assert samples[("splitserve_worker_kv_tier_capacity_blocks", frozenset(labels | {("tier", "host")}))] == 1
        assert samples[("splitserve_worker_kv_tier_dropped_blocks_total",
                        frozenset(labels | {("reason", "corrupt")}))] == 1
    finally:
        codes = cluster.close(grace_s=30.0)
    assert codes == [0] and not cluster.killed, cluster.outputs()[-6000:]


def test_a_decode_workers_host_tier_serves_its_reservation(llama_dir):
    """Disaggregated: the decode worker's pool (9 blocks) is too small for A and B together and
    its host tier holds five blocks. A, then B (each prefilled remotely) evict A's blocks into
    d0's host tier (some of them: the pool's eviction is near-LRU). Then:
    - A again: its uncached part is 3 tokens once the host tier counts, under the threshold, so
      d0 prefills it locally from the host tier (the prefill worker computes nothing);
    - C, A's prompt and 40 more tokens: prefilled remotely into a reservation whose first five
      blocks d0 loaded from its host tier. Both token-exact."""
    from splitserve.services.engine.config import EngineConfig
    from splitserve.services.engine.engine import LLMEngine
    from splitserve.services.worker_protocol.sampling_params import SamplingParams

    prompt_c = PROMPTS["A"] + [(i * 7) % 900 + 3 for i in range(40)]
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=32))
    [want_c] = engine.generate([prompt_c], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.close()
    cluster = Cluster(llama_dir, transfer="tcp")
    try:
        cluster.start_worker("d0", "decode", "--remote-prefill-threshold", "8",
                             "--kv-cache-gib", str(9.5 * BLOCK_BYTES / GIB),
                             "--kv-host-gib", str(5.5 * BLOCK_BYTES / GIB))
        cluster.start_worker("p0", "prefill")
        cluster.wait_workers()
        d0, p0 = cluster.workers["d0"].address, cluster.workers["p0"].address

        def run(prompt: list[int], rid: str):
            return asyncio.run(generate(d0, rid, prompt, 6, [("p0", p0)]))

        a1 = run(PROMPTS["A"], "a1")
        assert a1.prefilled_remotely and run(PROMPTS["B"], "b1").prefilled_remotely
        computed = worker_stats(p0).num_prompt_tokens_computed
        a2 = run(PROMPTS["A"], "a2")
        assert not a2.prefilled_remotely and list(a2.token_ids) == list(a1.token_ids)
        assert worker_stats(p0).num_prompt_tokens_computed == computed
        assert a2.replies[-1].num_cached_tokens == 5 * BLOCK     # pool and host tier together
        host_hits = {t.tier: t.num_hits for t in worker_stats(d0).kv_tiers}["host"]
        assert host_hits >= 1                                    # B evicted some of A's blocks at least

        run(PROMPTS["B"], "b2")                                 # A's blocks down to the host tier again
        c = run(prompt_c, "c")
        assert c.prefilled_remotely and list(c.token_ids) == want_c.token_ids
        assert c.replies[-1].num_cached_tokens == 5 * BLOCK
        assert {t.tier: t.num_hits for t in worker_stats(d0).kv_tiers}["host"] > host_hits
    finally:
        codes = cluster.close(grace_s=30.0)
    assert codes == [0, 0] and not cluster.killed, cluster.outputs()[-6000:]
