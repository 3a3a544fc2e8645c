"""Two vLLM workers behind splitserve's router: `splitserve serve --engine vllm --workers 2` (aggregated).

One server for the module (each vLLM start costs ~30-60 s of the 2-core budget); the tests run in
file order and each leaves both workers idle:
- the workers' KV events reach the router with splitserve's block hashes (a worker's KvEvents
  snapshot holds exactly `block_hashes(prompt)`), and the second of two requests sharing a
  ~1,000-token prefix goes to the worker holding it and reports cached tokens (openai client and
  raw HTTP); a salted prefix likewise, under its salted hashes;
- the frontend SIGKILLed: the supervisor restarts it and its new router rebuilds its index from
  the workers' events, routing the prefix to its holder again;
- a vLLM worker SIGKILLed under streaming load: every stream completes, token-exact (greedy,
  migrated by token replay), the supervisor restarts the worker, and no KV block leaks;
- a vLLM worker drained by SIGTERM under streaming load: its streams finish there or migrate (no
  error, token-exact), it exits 0, the supervisor restarts it, and no KV block is held anywhere;
- a vLLM worker's own Prometheus /metrics (`serve --worker-metrics`: `worker --metrics-port`, as the
  operator's pods run it), scraped over HTTP: load, KV usage, prefix-hit tokens, and the `vllm:`
  gauges an endpoint picker reads, once each although vLLM registers its own.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.block_hashes import block_hashes, salted_key
from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc
from splitserve.services.engine_vllm.kv_events import IPC_DIR_PREFIX
from splitserve.testing.metrics import scrape
from splitserve.testing.waiting import wait_until
from splitserve.testing.workers import wait_idle, worker_stats

from .conftest import VllmServer, start_vllm_serve, stop_vllm_serve

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm")]

PREFIX = [random.Random(38).randrange(100, 40000) for _ in range(1000)]
STREAM_TOKENS = 48
RESTART_TIMEOUT_S = 600


class Fleet:
    """`splitserve serve --engine vllm` with two aggregated workers and the kv router."""

    def __init__(self, server: VllmServer):
        self.server, self.proc, self.base, self.workers = server, server.proc, server.base_url, server.workers
        assert len(self.workers) == 2, self.proc.output
        self.client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=300)
        self.model = self.client.models.list().data[0].id
        self.metrics_urls = {m.group(1): m.group(2) for line in self.proc.lines
                             if (m := re.search(r"(worker-\d+) metrics on (\S+)$", line))}

    def describe(self, name: str) -> worker_pb2.DescribeResponse:
        with grpc.insecure_channel(self.workers[name]) as channel:
            return worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=10)

    def snapshot(self, name: str) -> set[bytes]:
        """The block hashes a worker's KV event hub holds now (what a new router's index starts from)."""
        with grpc.insecure_channel(self.workers[name]) as channel:
            call = worker_pb2_grpc.WorkerStub(channel).KvEvents(worker_pb2.KvEventsRequest(snapshot=True), timeout=10)
            batch = next(iter(call))
            call.cancel()
        return {h for ev in batch.events if ev.HasField("stored") for h in ev.stored.block_hashes}

    def served_by(self, send) -> tuple[str, object]:
        """(the worker that served `send()`'s request, its result), from the workers' request counts."""
        before = {n: worker_stats(a).num_requests for n, a in self.workers.items()}
        result = send()
        after = {n: worker_stats(a).num_requests for n, a in self.workers.items()}
        (name,) = [n for n in self.workers if after[n] > before[n]]
        return name, result

    def index_blocks(self) -> dict[str, float]:
        try:
            with urllib.request.urlopen(f"{self.base}/metrics", timeout=5) as reply:
                text = reply.read().decode()
        except (urllib.error.URLError, OSError):
            return {}
        return {w: float(v) for w, v in re.findall(r'splitserve_router_index_blocks\{worker="([^"]+)"\} (\S+)', text)}

    def wait_indexed(self, name: str, num_blocks: int, timeout: float = 30) -> None:
        wait_until(lambda: self.index_blocks().get(name, 0) >= num_blocks, timeout=timeout, interval=0.1,
                   what=f"the router's index to hold {num_blocks} blocks of {name}", details=self.index_blocks)

    def pid_of(self, name: str) -> int:
        for pid in self.proc.children():
            try:
                args = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
            except FileNotFoundError:
                continue
            if name == "frontend" and "frontend" in args:
                return pid
            if "--worker-id" in args and args[args.index("--worker-id") + 1] == name:
                return pid
        raise AssertionError(f"no child {name} of serve:\n{self.proc.tail()}")



@pytest.fixture(scope="module")
def fleet(vllm_python):
    server = start_vllm_serve(vllm_python, "--router", "kv", "--threads", "1", "--worker-metrics", num_workers=2)
    try:
        yield Fleet(server)
    finally:
        stop_vllm_serve(server)


def complete(fleet: Fleet, prompt: list[int], **extra_body):
    return fleet.client.completions.create(model=fleet.model, prompt=prompt, max_tokens=2, temperature=0,
                                           extra_body=extra_body or None)


def test_kv_routing_sends_a_shared_prefix_to_its_holder(fleet):
    holder, first = fleet.served_by(lambda: complete(fleet, PREFIX + [11, 12]))
    d = fleet.describe(holder)
    expected = block_hashes(PREFIX, d.block_size, d.block_hash_extra_key)
    # vLLM's events, republished by the worker with splitserve's hashes: the router's own hashes
    wait_until(lambda: set(expected) <= fleet.snapshot(holder), timeout=30, interval=0.1,
               what=f"{holder}'s KV events to hold the prefix's {len(expected)} blocks")
    other = next(n for n in fleet.workers if n != holder)
    assert not set(expected) & fleet.snapshot(other)
    fleet.wait_indexed(holder, len(expected))

    second_holder, second = fleet.served_by(lambda: complete(fleet, PREFIX + [21, 22, 23]))
    assert second_holder == holder
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= len(expected) * d.block_size - d.block_size
    raw_holder, raw = fleet.served_by(lambda: httpx.post(
        f"{fleet.base}/v1/completions", json={"model": fleet.model, "prompt": PREFIX + [31], "max_tokens": 2,
                                              "temperature": 0}, timeout=300))
    assert raw.status_code == 200, raw.text
    assert raw_holder == holder and raw.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    wait_idle(fleet.workers, 10.0)


def test_a_salted_prefix_is_published_and_routed_by_its_salted_hashes(fleet):
    """`cache_salt`: vLLM's events carry the salt on a chain's first block only; the worker publishes
    every block under the salted key, which is what the router computes for the salted request."""
    salt = "tenant-38"
    holder, first = fleet.served_by(lambda: complete(fleet, PREFIX + [71], cache_salt=salt))
    d = fleet.describe(holder)
    expected = block_hashes(PREFIX, d.block_size, salted_key(d.block_hash_extra_key, salt))
    assert not set(expected) & set(block_hashes(PREFIX, d.block_size, d.block_hash_extra_key))
    wait_until(lambda: set(expected) <= fleet.snapshot(holder), timeout=30, interval=0.1,
               what=f"{holder}'s KV events to hold the salted prefix's {len(expected)} blocks")
    assert first.usage.prompt_tokens_details.cached_tokens == 0      # the unsalted prefix is not shared
    again, second = fleet.served_by(lambda: complete(fleet, PREFIX + [72, 73], cache_salt=salt))
    assert again == holder and second.usage.prompt_tokens_details.cached_tokens > 0
    wait_idle(fleet.workers, 10.0)


def test_a_restarted_router_rebuilds_its_index_from_the_workers_events(fleet):
    holder, _ = fleet.served_by(lambda: complete(fleet, PREFIX + [41]))
    d = fleet.describe(holder)
    num_blocks = len(PREFIX) // d.block_size
    fleet.wait_indexed(holder, num_blocks)
    os.kill(fleet.pid_of("frontend"), signal.SIGKILL)
    fleet.proc.wait_for_line(r"splitserve: frontend restarted", 60)
    fleet.wait_indexed(holder, num_blocks, timeout=60)      # from the workers' snapshots alone
    again, reply = fleet.served_by(lambda: complete(fleet, PREFIX + [51, 52]))
    assert again == holder and reply.usage.prompt_tokens_details.cached_tokens > 0
    wait_idle(fleet.workers, 10.0)


def _streams(fleet: Fleet, prompts: list[list[int]], on_progress=None, max_tokens: int = STREAM_TOKENS
             ) -> tuple[list[list[int] | None], list[str]]:
    """Greedy streams of every prompt at once; (token ids per prompt, errors)."""
    async def one(client: openai.AsyncOpenAI, i: int, progress: list[int]) -> list[int]:
        tokens: list[int] = []
        stream = await client.completions.create(model=fleet.model, prompt=prompts[i], max_tokens=max_tokens,
                                                 temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in stream:
            if chunk.choices:
                tokens += chunk.choices[0].model_extra.get("token_ids") or []
                progress[i] = len(tokens)
        return tokens

    async def run():
        progress = [0] * len(prompts)
        async with openai.AsyncOpenAI(base_url=f"{fleet.base}/v1", api_key="unused", max_retries=0,
                                      timeout=600) as client:
            tasks = [asyncio.create_task(one(client, i, progress)) for i in range(len(prompts))]
            if on_progress is not None:
                await on_progress(progress)
            return await asyncio.gather(*tasks, return_exceptions=True)

    outcomes = asyncio.run(run())
    errors = [f"stream {i}: {type(o).__name__}: {o}" for i, o in enumerate(outcomes) if isinstance(o, BaseException)]
    return [None if isinstance(o, BaseException) else o for o in outcomes], errors


def test_sigkill_of_a_vllm_worker_under_load_loses_no_stream(fleet):
    prompts = [[random.Random(100 + i).randrange(100, 40000) for _ in range(24 + 7 * i)] for i in range(8)]
    reference, errors = _streams(fleet, prompts)
    assert errors == [] and all(len(t) == STREAM_TOKENS for t in reference), errors
    wait_idle(fleet.workers, 10.0)
    victim = "worker-0"
    num_kv_blocks = worker_stats(fleet.workers[victim]).num_kv_blocks

    running: list[int] = []
    killed: list[int] = []
    migrated_before = scrape(f"{fleet.base}/metrics", "splitserve_migrations_total", outcome="migrated")
    mark = len(fleet.proc.lines)           # serve's lines about this kill come after this one

    async def kill_when_streaming(progress: list[int]) -> None:
        deadline = time.monotonic() + 300
        while min(progress) < 4:
            assert time.monotonic() < deadline, f"streams stuck: {progress}"
            await asyncio.sleep(0.02)
        running.append(worker_stats(fleet.workers[victim]).num_running)
        assert running[0] > 0, "the victim runs no stream"
        killed.append(fleet.pid_of(victim))
        os.kill(killed[0], signal.SIGKILL)

    results, errors = _streams(fleet, prompts, kill_when_streaming)
    assert errors == [], errors
    assert results == reference          # greedy, so token replay on the other worker continues exactly
    migrated = scrape(f"{fleet.base}/metrics", "splitserve_migrations_total", outcome="migrated") - migrated_before
    assert migrated >= running[0], f"{running[0]} streams on the victim, {migrated} migrated"
    fleet.proc.wait_for_line(rf"splitserve: {victim} is serving again", RESTART_TIMEOUT_S, after=mark)
    assert f"{victim} exited with code -9; restarting it" in fleet.proc.output
    # The killed worker could not remove its KV-event socket's folder; its successor did.
    assert not list(Path(tempfile.gettempdir()).glob(f"{IPC_DIR_PREFIX}{killed[0]}-*"))
    wait_until(lambda: scrape(f"{fleet.base}/metrics", "splitserve_worker_restarts_total", worker=victim) >= 1,
               timeout=30, what=f"the frontend to count {victim}'s restart")
    idle = wait_idle(fleet.workers, 60.0)             # no request holds a block on either worker
    assert idle.stats[victim].num_kv_blocks == num_kv_blocks
    # the frontend sees the new instance and routes to it again: a burst spreads over both workers
    before = worker_stats(fleet.workers[victim]).num_requests
    _, errors = _streams(fleet, [[random.Random(200 + i).randrange(100, 40000) for _ in range(30)]
                                     for i in range(6)])
    assert errors == [] and worker_stats(fleet.workers[victim]).num_requests > before
    wait_idle(fleet.workers, 10.0)


DRAIN_TOKENS = 160       # longer than serve's drain timeout (7 s) on these CPUs: some streams migrate


def test_sigterm_drains_a_vllm_worker_without_a_client_error(fleet):
    """SIGTERM is how serve, Kubernetes and the autoscaler stop a worker: it stops admitting,
    its running streams get serve's drain timeout to finish, the rest fail with UNAVAILABLE and
    the frontend migrates them (token replay); it exits 0 and the supervisor starts it again
    (before, serve's supervisor took the NOT_SERVING drain for failed health checks and
    SIGKILLed the worker 6 s into it)."""
    prompts = [[random.Random(300 + i).randrange(100, 40000) for _ in range(20 + 5 * i)] for i in range(4)]
    reference, errors = _streams(fleet, prompts, max_tokens=DRAIN_TOKENS)
    assert errors == [] and all(len(t) == DRAIN_TOKENS for t in reference), errors
    wait_idle(fleet.workers, 10.0)
    num_kv_blocks = {name: worker_stats(address).num_kv_blocks for name, address in fleet.workers.items()}
    migrated_before = scrape(f"{fleet.base}/metrics", "splitserve_migrations_total", outcome="migrated")
    running: dict[str, int] = {}
    victims: list[str] = []
    mark = len(fleet.proc.lines)           # an earlier test's restart printed "is serving again" too

    async def sigterm_when_streaming(progress: list[int]) -> None:
        deadline = time.monotonic() + 300
        while min(progress) < 4:
            assert time.monotonic() < deadline, f"streams stuck: {progress}"
            await asyncio.sleep(0.02)
        running.update({name: worker_stats(address).num_running for name, address in fleet.workers.items()})
        victim = max(running, key=running.get)          # the worker running more of the streams
        assert running[victim] > 0, f"no worker runs a stream: {running}"
        victims.append(victim)
        os.kill(fleet.pid_of(victim), signal.SIGTERM)

    results, errors = _streams(fleet, prompts, sigterm_when_streaming, DRAIN_TOKENS)
    assert errors == [], errors
    assert results == reference
    [victim] = victims
    fleet.proc.wait_for_line(rf"splitserve: {victim} exited with code 0; restarting it", 90, after=mark)
    # serve's supervisor saw it draining and let it finish, instead of killing it as a failing worker
    assert f"splitserve: {victim} is draining" in fleet.proc.output
    assert f"splitserve: {victim} failed" not in fleet.proc.output
    migrated = scrape(f"{fleet.base}/metrics", "splitserve_migrations_total", outcome="migrated") - migrated_before
    print(f"drain: {running[victim]} streams on {victim}, {migrated:g} migrated after the drain timeout")
    fleet.proc.wait_for_line(rf"splitserve: {victim} is serving again", RESTART_TIMEOUT_S, after=mark)
    idle = wait_idle(fleet.workers, 60.0)             # no request holds a block on either worker
    assert {name: s.num_kv_blocks for name, s in idle.stats.items()} == num_kv_blocks


def test_a_vllm_workers_stats_are_its_prometheus_metrics(fleet):
    """A vLLM worker's own /metrics (`serve --worker-metrics` gives each worker `--metrics-port`,
    as the operator does), built from its Stats (services/worker/stats_metrics.py), over HTTP."""
    name, _ = fleet.served_by(lambda: complete(fleet, PREFIX + [61]))
    assert fleet.served_by(lambda: complete(fleet, PREFIX + [62]))[0] == name
    address = fleet.workers[name]
    reply = httpx.get(fleet.metrics_urls[name], timeout=10)     # the vLLM worker's own /metrics server
    assert reply.status_code == 200, reply.text
    samples = {s.name: s.value for family in text_string_to_metric_families(reply.text)
               for s in family.samples}
    stats = worker_stats(address)
    assert samples["splitserve_worker_kv_blocks"] == stats.num_kv_blocks > 0
    assert samples["splitserve_worker_kv_usage"] == 0 and samples["splitserve_worker_kv_blocks_cached"] > 0
    assert samples["splitserve_worker_requests_running"] == samples["splitserve_worker_requests_waiting"] == 0
    assert samples["splitserve_worker_prefix_hit_tokens_total"] >= len(PREFIX) - fleet.describe(name).block_size
    assert samples["splitserve_worker_generated_tokens_total"] > 0
    assert samples["splitserve_worker_engine_steps_total"] > 0
    # vLLM's own collectors are in the worker's registry (its other families are served) but the
    # gauges an endpoint picker reads come once each, from the same Stats, named as Describe names
    # the model: a name twice would make the picker's text parser refuse the whole scrape.
    families = {family.name: family for family in text_string_to_metric_families(reply.text)}
    assert "vllm:time_to_first_token_seconds" in families
    info = fleet.describe(name)
    labels = {"model_name": info.model_name, "engine": "0"}
    for metric, value in (("vllm:num_requests_waiting", 0), ("vllm:num_requests_running", 0),
                          ("vllm:kv_cache_usage_perc", stats.kv_usage)):
        assert reply.text.count(f"# TYPE {metric} gauge") == 1, metric
        assert [(s.labels, s.value) for s in families[metric].samples] == [(labels, value)], metric
    [cache] = families["vllm:cache_config_info"].samples
    assert reply.text.count("# TYPE vllm:cache_config_info gauge") == 1
    assert cache.labels == {**labels, "block_size": str(info.block_size), "num_gpu_blocks": str(stats.num_kv_blocks)}
