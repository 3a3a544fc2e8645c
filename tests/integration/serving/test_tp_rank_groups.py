"""Tensor-parallel groups whose ranks are independent `splitserve worker` processes (as pods run them).

Each rank is started on its own with SPLITSERVE_TP_RANK / _WORLD_SIZE / _LEADER (none
forked from another; rank 1 first, so it waits for its leader), on the random-weight
Llama (2 KV heads: one per rank), on 127.0.0.1 over gloo:

- an aggregated TP=2 group: greedy output of Generate equals the single-process TP=1
  engine's, for prompts inside one block, over several blocks and over two prefill
  chunks;
- a disaggregated TP=2 prefill group feeding a TP=1 decode worker and a TP=2 decode
  group over TCP: the same output, prefilled remotely, each rank writing (or receiving)
  its own KV heads on its own connector, and nothing left held on either side;
- rank 0 alone: it gives up after its join timeout, exits non-zero and names rank 1;
- rank 1 of a serving group killed mid-request: the request fails with UNAVAILABLE (what
  frontends migrate) and rank 0 exits 1 within seconds (the group is replaced as a unit);
  rank 0 killed: rank 1 exits by itself.

The surviving groups stop cleanly on SIGTERM (every rank exits 0).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import grpc
import pytest

from splitserve.net import free_port
from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.testing.cluster import Cluster
from splitserve.testing.models import random_prompt
from splitserve.testing.workers import generate, wait_idle, wait_running, worker_stats

MAX_TOKENS = 6
THRESHOLD = 32
EXIT_WITHIN_S = 30.0


PROMPTS = {"one-block": random_prompt(1, 10), "blocks": random_prompt(2, 130), "two-chunks": random_prompt(3, 300),
           "remote-one-block": random_prompt(4, 40), "remote-blocks": random_prompt(5, 130),
           "remote-two-chunks": random_prompt(6, 300)}
LONG_PROMPT = random_prompt(7, 2500)          # long enough to be running when its group breaks


@pytest.fixture(scope="module")
def expected(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=256, num_threads=1))
    results = engine.generate(list(PROMPTS.values()), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return {name: r.token_ids for name, r in zip(PROMPTS, results)}


@pytest.fixture(scope="module")
def cluster(llama_dir):
    cluster = Cluster(llama_dir, kv_cache_gib=0.02, transfer="tcp")
    budget = ("--max-num-batched-tokens", "256")
    try:
        cluster.groups = {"a2": cluster.start_rank_group("a2", "both", 2, *budget),
                          "p2": cluster.start_rank_group("p2", "prefill", 2, *budget)}
        decode_args = (*budget, "--remote-prefill-threshold", str(THRESHOLD), "--prefill-timeout", "20")
        cluster.start_worker("d1", "decode", *decode_args)
        cluster.groups["d2"] = cluster.start_rank_group("d2", "decode", 2, *decode_args)
        cluster.wait_workers()          # rank 0 reports ready only once its whole group has
        yield cluster
    finally:
        codes = cluster.close(grace_s=60.0)
    assert not cluster.killed, "a rank did not stop on SIGTERM"
    assert codes == [0] * len(codes), cluster.outputs()[-6000:]


def _exit_code_within(proc, timeout_s: float) -> int:
    try:
        return proc.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running {timeout_s:.0f} s later:\n{proc.tail()}") from None


def test_ranks_were_started_independently(cluster):
    """No rank is a child of another: each is its own `splitserve worker`, and rank 0 starts no ranks."""
    for rank0, others in cluster.groups.values():
        assert rank0.proc.children() == [], rank0.proc.tail()
        for proc in others:
            assert proc.pid not in rank0.proc.children()
            assert proc.alive(), proc.tail()
            assert any("tensor-parallel rank 1/2: joined" in line for line in proc.lines), proc.tail()


def test_aggregated_group_greedy_output_equals_tp1(cluster, expected):
    a2 = cluster.workers["a2"].address
    for name in ("one-block", "blocks", "two-chunks"):
        out = asyncio.run(generate(a2, f"a2-{name}", PROMPTS[name], MAX_TOKENS))
        assert out.token_ids == expected[name], name
    wait_idle({"a2": a2}, 2.0)


@pytest.mark.parametrize("decode", ["d1", "d2"])
def test_prefill_group_feeds_a_decode_worker(cluster, expected, decode):
    """TP=2 prefill group → TP=1 decode worker, and → TP=2 decode group (each decode rank
    reserves and is notified on its own connector, its events crossing the TCP control
    channel)."""
    p2, d = cluster.workers["p2"].address, cluster.workers[decode].address
    before = worker_stats(p2)
    names = [n for n in PROMPTS if n.startswith("remote-")]
    for name in names:
        out = asyncio.run(generate(d, f"p2-{decode}-{name}", PROMPTS[name], MAX_TOKENS, [("p2", p2)]))
        assert out.token_ids == expected[name], (decode, name)
        assert out.prefilled_remotely, (decode, name)
    assert worker_stats(p2).num_prefills_served - before.num_prefills_served == len(names)
    wait_idle({"p2": p2, decode: d}, 2.0)


def test_rank0_alone_gives_up_naming_the_missing_rank(llama_dir):
    lonely = Cluster(llama_dir, kv_cache_gib=0.02)
    try:
        start = time.monotonic()
        rank0 = lonely.start_worker("lonely", "both", env={
            "SPLITSERVE_TP_RANK": "0", "SPLITSERVE_TP_WORLD_SIZE": "2",
            "SPLITSERVE_TP_LEADER": f"127.0.0.1:{free_port()}", "SPLITSERVE_TP_JOIN_TIMEOUT": "3"})
        code = _exit_code_within(rank0.proc, 60.0)
        assert code != 0
        assert time.monotonic() - start < 60.0
        assert "tensor-parallel rank(s) 1 of 2 did not join" in rank0.proc.output, rank0.proc.tail()
        assert not any("ready" in line for line in rank0.proc.lines if "worker lonely" in line)
    finally:
        lonely.close()


def test_a_lost_rank_fails_rank0(cluster):
    """Rank 1 of the aggregated group killed mid-request: the request fails with UNAVAILABLE
    (a frontend migrates it), and rank 0 exits 1 at once, so that the operator replaces the
    group. (Kills a2.)"""
    rank0, (rank1,) = cluster.groups["a2"]
    a2 = cluster.workers["a2"].address

    async def killed_mid_request():
        task = asyncio.create_task(generate(a2, "a2-killed", LONG_PROMPT, 400))
        await wait_running(a2, task)
        rank1.process.send_signal(signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await task
        return failure.value.code()

    assert asyncio.run(killed_mid_request()) == grpc.StatusCode.UNAVAILABLE
    assert _exit_code_within(rank0.proc, EXIT_WITHIN_S) == 1
    assert "worker a2 failed: tensor-parallel rank 1 is gone" in rank0.proc.output, rank0.proc.tail()


def test_a_lost_rank0_fails_its_ranks(cluster):
    """Rank 0 of the prefill group killed: its rank 1 exits by itself, non-zero. (Kills p2.)"""
    rank0, (rank1,) = cluster.groups["p2"]
    rank0.proc.process.send_signal(signal.SIGKILL)
    assert _exit_code_within(rank1, EXIT_WITHIN_S) != 0


def test_local_ranks_fail_the_same_way(llama_dir, expected):
    """Without the environment, `--tp 2` starts its rank locally, as before; that rank
    killed, rank 0 exits 1 too (it used to stay up and fail every request)."""
    local = Cluster(llama_dir, kv_cache_gib=0.02)
    try:
        worker = local.start_worker("local2", "both", "--tp", "2")
        worker.wait_ready()
        out = asyncio.run(generate(worker.address, "local2-one-block", PROMPTS["one-block"], MAX_TOKENS))
        assert out.token_ids == expected["one-block"]
        ranks = [pid for pid in worker.proc.children()
                 if "spawn_main" in open(f"/proc/{pid}/cmdline").read().replace("\0", " ")]
        assert len(ranks) == 1, worker.proc.tail()
        os.kill(ranks[0], signal.SIGKILL)
        assert _exit_code_within(worker.proc, EXIT_WITHIN_S) == 1
        assert "worker local2 failed: tensor-parallel rank 1 is gone" in worker.proc.output, worker.proc.tail()
    finally:
        local.close()
