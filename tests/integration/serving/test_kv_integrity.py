"""KV that went wrong in a prefill -> decode transfer never becomes a token (issue 41).

Real `splitserve worker` processes (a decode worker and a prefill worker) over TCP and over NIXL.
The prefill worker runs with the fault switch (SPLITSERVE_KV_FAULTS, kvtransfer/faults.py):
`transfer=corrupt@0.75` (a seeded three quarters of its sends post their middle layer from other
source blocks) or `transfer=drop` (every send leaves its middle layer unwritten). The decode
worker's digest check (transfer_digest.py) refuses each damaged transfer and prefills the prompt
itself: every answer is the aggregated engine's greedy output, the decode worker's
`splitserve_kv_transfer_digest_mismatches` equals the faults the prefill worker logged, and every
prompt that was not damaged was served from the prefill worker's KV.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest

from splitserve.net import free_port
from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.testing.cluster import Cluster
from splitserve.testing.workers import generate, wait_idle, worker_stats

PROMPTS = [[(13 * i + 57 * k) % 31000 + 5 for i in range(90 + 7 * k)] for k in range(8)]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def expected(llama_dir) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=256, num_threads=1))
    try:
        results = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    finally:
        engine.close()
    return [r.token_ids for r in results]


def _mismatches(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = re.findall(r"^splitserve_kv_transfer_digest_mismatches_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return sum(float(v) for v in found)


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
@pytest.mark.parametrize("fault", ["transfer=corrupt@0.75", "transfer=drop"])
def test_damaged_transfers_are_refused_and_recomputed_token_exact(llama_dir, expected, backend, fault):
    cluster = Cluster(llama_dir, transfer=backend)
    metrics_port = free_port()
    try:
        cluster.start_worker("d0", "decode", "--transfer", backend, "--remote-prefill-threshold", "32",
                             "--metrics-port", str(metrics_port))
        cluster.start_worker("p0", "prefill", "--transfer", backend,
                             env={"SPLITSERVE_KV_FAULTS": fault, "SPLITSERVE_KV_FAULT_SEED": "41"})
        cluster.wait_workers()
        d0, p0 = cluster.workers["d0"].address, cluster.workers["p0"].address
        before = worker_stats(d0)
        served = []
        for i, prompt in enumerate(PROMPTS):
            out = asyncio.run(generate(d0, f"r{i}", prompt, MAX_TOKENS, [("p0", p0)]))
            assert list(out.token_ids) == expected[i], (i, fault)
            served.append(out.prefilled_remotely)
        wait_idle({"d0": d0, "p0": p0}, 15.0)
        injected = sum("KV faults: injecting transfer=" in line for line in cluster.workers["p0"].proc.lines)
        assert injected >= len(PROMPTS) // 2, "the fault hit fewer requests than it should"
        assert _mismatches(metrics_port) == injected
        after = worker_stats(d0)
        assert after.num_local_prefills - before.num_local_prefills == injected
        assert sum(served) == len(PROMPTS) - injected
    finally:
        codes = cluster.close(grace_s=30.0)
    assert not cluster.killed and codes == [0] * len(codes), cluster.outputs()[-6000:]
