"""`splitserve serve --engine vllm` with prefill and decode pools: splitserve's KV connector inside
vLLM on both sides (issue 39, services/engine_vllm/kv_connector.py), over NIXL (1 prefill + 2
decode workers) and over TCP (1 + 1).

- Greedy outputs equal vLLM's own aggregated `LLM.generate` for prompts of 10, 500 and 2,000
  tokens, every one of them prefilled by the prefill worker (its KV pushed, none recomputed).
- The KV moved layer by layer: the prefill worker's connector saw the first layer's writes
  complete before it computed the prompt's last layer (its own timestamps, /metrics).
- Faults: a layer dropped or corrupted on purpose (refused by the digest check, recomputed), a
  client gone during the transfer, the prefill worker SIGKILLed during the transfer, a decode
  worker SIGKILLed under load: every request completes token for token or fails cleanly, and the
  workers left return to idle (no block used, held or fenced).

Over TCP only what the transport changes runs again (outputs, layer-wise arrival, a corrupted
layer refused); the cancellation and kill paths are the connector's and the engine's, the same
over either transport, and run over NIXL (two decode workers). Each 2,000-token prefill costs
seconds here, so the module stays within a few minutes of CI.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from splitserve.testing.metrics import scrape
from splitserve.testing.waiting import async_wait_until, wait_until
from splitserve.testing.workers import generate, wait_idle, worker_stats

from .conftest import start_vllm_serve, stop_vllm_serve

MAX_TOKENS = 16
PROMPT_LENGTHS = (10, 500, 2000)
IDLE_LIMIT_S = 60.0           # a fence waits for the prefill worker's answer (or a refused connection)
STATS_TIMEOUT_S = 30.0        # a worker answers Stats between steps; a 512-token prefill chunk takes seconds here
# vLLM prefills in chunks of this many tokens: a 2,000-token prompt is four steps (and four rounds of
# layer reports), and no step holds a worker's Stats for long.
CHUNK_TOKENS = "512"
TEXT = ("The history of the printing press begins with movable type in East Asia and continues with "
        "Gutenberg's press in Mainz, which spread across Europe within decades. ")


@pytest.fixture(scope="module", params=[("nixl", (1, 2)), ("tcp", (1, 1))], ids=["nixl-1p2d", "tcp-1p1d"])
def disagg_server(request, vllm_python, tmp_path_factory):
    backend, pools = request.param
    fault_file = tmp_path_factory.mktemp("kv-fault") / "fault"      # absent: no fault (rank_transfer.py)
    # --prefill-timeout bounds a remote prefill including its wait in the prefill worker's queue: the
    # first test queues six prompts (5,020 tokens) there at once, which a 2-core CI machine busy with
    # the other xdist worker took longer than the default 30 s to clear (the decode worker then
    # prefilled two itself).
    server = start_vllm_serve(vllm_python, "--transfer", backend, "--remote-prefill-threshold", "1",
                              "--prefill-timeout", "300", "--worker-metrics", disaggregated=pools,
                              vllm_args=("--max-num-batched-tokens", CHUNK_TOKENS),
                              env={"SPLITSERVE_KV_FAULT_FILE": str(fault_file)})
    server.fault_file = fault_file
    server.metrics = {m.group(1): m.group(2) for line in server.proc.lines
                      if (m := re.search(r"((?:prefill|decode)-\d+) metrics on (\S+)$", line))}
    server.backend = backend
    try:
        assert any(f"KV transfer between prefill and decode workers: {backend}" in line for line in server.proc.lines)
        yield server
    finally:
        stop_vllm_serve(server)


# Parametrizing the module's server with one of its own params reuses the running server.
over_nixl_only = pytest.mark.parametrize("disagg_server", [("nixl", (1, 2))], ids=["nixl-1p2d"], indirect=True)
# Each test that needs the KV to move while it watches gets a prompt no other test sends: a worker
# that cached it would leave little or nothing to compute and move. (name, offset, length)
PROMPTS = [(f"sized-{n}", i, n) for i, n in enumerate(PROMPT_LENGTHS)] + [
    ("layer", 40, 2000), ("cancel", 80, 2000), ("kill-prefill", 120, 2000),
    ("drop", 50, 400), ("corrupt", 57, 400)]


@pytest.fixture(scope="module")
def prompts(tokenize) -> dict[str, list[int]]:
    ids = tokenize(TEXT * 100)
    assert len(ids) >= max(offset + n for _, offset, n in PROMPTS)
    return {name: ids[offset:offset + n] for name, offset, n in PROMPTS}


@pytest.fixture(scope="module")
def expected(reference_generate, prompts) -> dict[str, list[int]]:
    """vLLM's own greedy tokens for every prompt (one aggregated LLM.generate batch)."""
    return dict(zip(prompts, reference_generate(list(prompts.values()), MAX_TOKENS, ignore_eos=True)))


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=300)


def _tokens(client: openai.OpenAI, prompt: list[int]) -> list[int]:
    reply = client.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    return reply.choices[0].token_ids


def _decoders(server) -> dict[str, str]:
    return {name: address for name, address in server.workers.items() if name.startswith("decode")}


def _pid(server, name: str) -> int:
    """The pid of serve's worker `name` now (serve restarts a worker that died, under a new pid)."""
    [pid] = [pid for pid in server.proc.children() if f"--worker-id\0{name}\0" in _cmdline(pid)]
    return pid


def _cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline").read()
    except FileNotFoundError:            # exited meanwhile
        return ""


def test_greedy_tokens_equal_vllm_generate_with_every_prompt_prefilled_remotely(disagg_server, prompts, expected):
    decoders = _decoders(disagg_server)
    before = {name: worker_stats(address, STATS_TIMEOUT_S) for name, address in decoders.items()}
    client = _client(disagg_server)
    sized = [name for name in prompts if name.startswith("sized-")]
    with ThreadPoolExecutor(2 * len(sized)) as pool:          # each prompt twice, all at once
        got = list(pool.map(lambda name: _tokens(client, prompts[name]), sized + sized))
    assert got == [expected[name] for name in sized] * 2
    after = {name: worker_stats(address, STATS_TIMEOUT_S) for name, address in decoders.items()}
    assert sum(after[n].num_remote_prefills - before[n].num_remote_prefills for n in decoders) == 2 * len(sized)
    assert all(after[n].num_prefill_fallbacks == before[n].num_prefill_fallbacks for n in decoders)
    prefill = disagg_server.workers["prefill-0"]
    # Every decode worker pairs with the prefill worker (the frontend's router picked above).
    for i, address in enumerate(decoders.values()):
        out = _run(generate(address, f"direct-{i}", prompts["sized-500"], MAX_TOKENS, [("prefill-0", prefill)]))
        assert out.prefilled_remotely and out.token_ids == expected["sized-500"]
    wait_idle(disagg_server.workers, IDLE_LIMIT_S, stats_timeout_s=STATS_TIMEOUT_S)


def test_the_kv_moved_layer_by_layer(disagg_server, prompts, expected):
    """The prefill worker's connector: the first layer's writes of the 2,000-token prompt had landed
    (completed at the decode worker) before the prefill computed its last layer."""
    url = disagg_server.metrics["prefill-0"]
    name = "splitserve_kv_transfer_layer_lead_seconds"
    count, not_ahead = scrape(url, f"{name}_count"), scrape(url, f"{name}_bucket", le="0.0")
    assert _tokens(_client(disagg_server), prompts["layer"]) == expected["layer"]
    assert scrape(url, f"{name}_count") == count + 1
    assert scrape(url, f"{name}_bucket", le="0.0") == not_ahead, "layer 0 landed only after the last layer"


def test_a_layer_corrupted_on_purpose_is_refused_and_recomputed_not_decoded(disagg_server, prompts, expected):
    """The prefill worker's connector writes its middle layer from the wrong blocks: the decode
    worker's digest check refuses the KV and prefills locally; the output is unchanged."""
    _fault_is_recomputed(disagg_server, prompts, expected, "corrupt")


@over_nixl_only
def test_a_layer_dropped_on_purpose_is_refused_and_recomputed_not_decoded(disagg_server, prompts, expected):
    """The prefill worker's connector never writes its middle layer (the decode worker's blocks keep
    what they held): refused by the digest check, prefilled locally, the output unchanged."""
    _fault_is_recomputed(disagg_server, prompts, expected, "drop")


def _fault_is_recomputed(disagg_server, prompts, expected, fault: str) -> None:
    decoders = _decoders(disagg_server)
    before = sum(worker_stats(a, STATS_TIMEOUT_S).num_prefill_fallbacks for a in decoders.values())
    disagg_server.fault_file.write_text(fault)
    try:
        assert _tokens(_client(disagg_server), prompts[fault]) == expected[fault]
    finally:
        disagg_server.fault_file.unlink()
    assert sum(worker_stats(a, STATS_TIMEOUT_S).num_prefill_fallbacks for a in decoders.values()) == before + 1
    refused = sum(scrape(url, "splitserve_kv_transfer_digest_mismatches_total")
                  for name, url in disagg_server.metrics.items() if name.startswith("decode"))
    assert refused >= 1
    wait_idle(disagg_server.workers, IDLE_LIMIT_S, stats_timeout_s=STATS_TIMEOUT_S)


@over_nixl_only
def test_a_client_gone_during_the_transfer_leaves_both_sides_idle(disagg_server, prompts, expected):
    decoders = _decoders(disagg_server)

    async def leave_during_the_transfer() -> None:
        body = {"model": "smollm2", "prompt": prompts["cancel"], "max_tokens": MAX_TOKENS, "temperature": 0,
                "stream": True, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=300) as http:
            request = asyncio.create_task(http.post(f"{disagg_server.openai_url}/completions", json=body))
            await async_wait_until(lambda: any(worker_stats(a, STATS_TIMEOUT_S).num_remote_prefill
                                               for a in decoders.values()), timeout=60, interval=0.01,
                                   what="a decode worker to wait for the prefill worker's KV")
            request.cancel()                 # the client is gone while the KV moves
            with contextlib.suppress(asyncio.CancelledError):
                await request

    asyncio.run(leave_during_the_transfer())
    wait_idle(disagg_server.workers, IDLE_LIMIT_S, stats_timeout_s=STATS_TIMEOUT_S)
    assert _tokens(_client(disagg_server), prompts["cancel"]) == expected["cancel"]
    wait_idle(disagg_server.workers, IDLE_LIMIT_S, stats_timeout_s=STATS_TIMEOUT_S)


@over_nixl_only
def test_the_prefill_worker_killed_during_the_transfer_costs_a_local_prefill_not_a_token(
        disagg_server, prompts, expected):
    decoders = _decoders(disagg_server)
    before = {name: worker_stats(address, STATS_TIMEOUT_S).num_prefill_fallbacks for name, address in decoders.items()}
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(_tokens, _client(disagg_server), prompts["kill-prefill"])
        wait_until(lambda: worker_stats(disagg_server.workers["prefill-0"], STATS_TIMEOUT_S).num_running > 0,
                   timeout=60, interval=0.005, what="the prefill worker to compute the prompt")
        os.kill(_pid(disagg_server, "prefill-0"), signal.SIGKILL)
        assert reply.result(timeout=300) == expected["kill-prefill"]
    after = {name: worker_stats(address, STATS_TIMEOUT_S).num_prefill_fallbacks for name, address in decoders.items()}
    assert sum(after.values()) == sum(before.values()) + 1
    # The dead writer's fence: its address refuses connections.
    wait_idle(decoders, IDLE_LIMIT_S, stats_timeout_s=STATS_TIMEOUT_S)
    wait_until(lambda: _prefill_answers(disagg_server), timeout=300, interval=0.5,
               what="serve to restart the prefill worker (on its port)")


def _prefill_answers(server) -> bool:
    try:
        return worker_stats(server.workers["prefill-0"], timeout=2).num_running == 0
    except Exception:            # restarting: refused or not serving yet
        return False


@over_nixl_only
def test_a_decode_worker_killed_under_load_loses_no_token(disagg_server, prompts, expected):
    """Six streams over both decode workers; decode-0 is SIGKILLed once tokens flow: each stream
    completes token for token (the frontend migrates decode-0's to decode-1)."""
    client = _client(disagg_server)
    flowing = threading.Event()

    def stream(prompt: list[int]) -> list[int] | str:
        tokens: list[int] = []
        try:
            for chunk in client.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS,
                                                   temperature=0, stream=True,
                                                   extra_body={"return_token_ids": True, "ignore_eos": True}):
                tokens += chunk.choices[0].token_ids or []
                flowing.set()
        except openai.APIError as error:
            return f"error: {error}"
        return tokens

    jobs = [("sized-10", "sized-500")[i % 2] for i in range(6)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = [pool.submit(stream, prompts[name]) for name in jobs]
        assert flowing.wait(300)
        os.kill(_pid(disagg_server, "decode-0"), signal.SIGKILL)
        outcomes = [r.result(timeout=300) for r in results]
    assert outcomes == [expected[name] for name in jobs]
    wait_idle({n: a for n, a in disagg_server.workers.items() if n != "decode-0"}, IDLE_LIMIT_S,
              stats_timeout_s=STATS_TIMEOUT_S)


def _run(coro):
    return asyncio.run(coro)
