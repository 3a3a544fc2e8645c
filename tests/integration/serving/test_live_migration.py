"""Live migration that moves the KV (issue 41), end to end: `splitserve serve` with one prefill and
two decode workers, a request streaming through the official `openai` client, and an operator
moving it mid-stream with `splitserve admin migrate` (and POST /admin/migrate).

At 2k and 8k tokens of context (the random Llama with 16k positions), greedy and seeded: the
moved stream is token for token the unmoved one; the answer says the KV moved (not replayed) to
the other decode worker; the destination received it and the source sent it (worker counters);
and every worker is idle afterwards (no suspended request, block or reservation left). Over NIXL,
what `serve` picks (over TCP: tests/integration/faults/test_worker_faults.py, where a draining
decode worker's streams move with their KV). Token replay, asked for, gives the same tokens; a move of an unknown
request or to an unknown worker is refused with an OpenAI-style error.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import openai
import pytest

from splitserve.testing.models import build_random_model, random_prompt
from splitserve.testing.waiting import async_wait_until
from splitserve.testing.workers import wait_idle, worker_stats

from .conftest import start_serve, stop_serve

MOVE_AFTER = 8            # tokens streamed before the move
MAX_TOKENS = 200          # long enough that the stream still runs when a POST /admin/migrate lands
CLI_MAX_TOKENS = 600      # ... and when `splitserve admin migrate` (a process to start) does
# (context tokens, seed or None for greedy, moved by the CLI)
NIXL_CASES = [(2048, None, True), (2048, 11, False), (8192, None, False), (8192, 11, False)]


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    """The random Llama with room for 8k-token contexts."""
    return build_random_model("llama", tmp_path_factory.mktemp("llama-16k"), seed=0, max_position_embeddings=16384)


@pytest.fixture(scope="module")
def deployment(request, long_llama):
    server = start_serve(str(long_llama), "--transfer", request.param, "--prefill-workers", "1",
                         "--decode-workers", "2", "--kv-cache-gib", "0.2", num_workers=3, aggregated=False)
    try:
        yield request.param, server
    finally:
        stop_serve(server)


def _body(model: str, prompt: list[int], seed: int | None, max_tokens: int = MAX_TOKENS) -> dict:
    sampling = {"temperature": 0} if seed is None else {"temperature": 0.9, "top_p": 0.95, "seed": seed}
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "return_token_ids": True, **sampling}


async def _stream(base: str, body: dict, move=None) -> tuple[list[int], str, object]:
    """The stream's token ids, its finish reason, and what `move(request_id)` returned when it was
    started once MOVE_AFTER tokens had arrived."""
    tokens, reason, moving = [], None, None
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as reply:
            assert reply.status_code == 200, await reply.aread()
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                choice = chunk["choices"][0]
                tokens += choice.get("token_ids") or []
                reason = choice.get("finish_reason") or reason
                if move is not None and moving is None and len(tokens) >= MOVE_AFTER:
                    moving = asyncio.ensure_future(move(chunk["id"]))
    return tokens, reason, None if moving is None else await moving


async def _post_migrate(base: str, request_id: str) -> dict:
    async with httpx.AsyncClient(timeout=60) as client:
        reply = await client.post(f"{base}/admin/migrate", json={"request_id": request_id})
        assert reply.status_code == 200, reply.text
        return reply.json()


async def _admin(base: str, action: str, *extra: str) -> bytes:
    """`splitserve admin ACTION --url BASE --json ...`, as an operator runs it; its output."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "splitserve", "admin", action, "--url", base, "--json", *extra,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return out


async def _admin_migrate(base: str, request_id: str) -> dict:
    return json.loads(await _admin(base, "migrate", "--request", request_id))


def _decode_counters(server) -> dict[str, tuple[int, int, int]]:
    return {name: (s.num_suspended, s.num_kv_migrations_sent, s.num_kv_migrations_received)
            for name, address in server.workers.items() if name.startswith("decode")
            for s in [worker_stats(address)]}


@pytest.mark.parametrize("context,seed,by_cli", NIXL_CASES,
                         ids=[f"{c // 1024}k-{'seeded' if s else 'greedy'}{'-cli' if cli else ''}"
                              for c, s, cli in NIXL_CASES])
@pytest.mark.parametrize("deployment", ["nixl"], indirect=True)
def test_a_request_moved_mid_stream_continues_token_exact_with_its_kv(deployment, context, seed, by_cli):
    _check_move(deployment[1], context, seed, by_cli)


def _check_move(server, context: int, seed: int | None, by_cli: bool) -> None:
    base = server.base_url
    model = openai.OpenAI(base_url=server.openai_url, api_key="unused").models.list().data[0].id
    prompt = random_prompt(context + (seed or 0), context - MOVE_AFTER - 4)
    max_tokens = CLI_MAX_TOKENS if by_cli else MAX_TOKENS
    body = _body(model, prompt, seed, max_tokens)
    before = _decode_counters(server)

    unmoved, unmoved_reason, _ = asyncio.run(_stream(base, body))
    move = (lambda rid: _admin_migrate(base, rid)) if by_cli else (lambda rid: _post_migrate(base, rid))
    moved, reason, answer = asyncio.run(_stream(base, body, move))

    assert len(unmoved) == max_tokens and unmoved_reason == "length"
    assert moved == unmoved and reason == "length"
    assert answer["method"] == "kv", answer
    assert answer["from"] != answer["to"] and {answer["from"], answer["to"]} == {"decode-0", "decode-1"}
    assert answer["num_tokens"] >= MOVE_AFTER and answer["seconds_to_next_token"] > 0
    after = _decode_counters(server)
    grew = {name: tuple(a - b for a, b in zip(after[name], before[name])) for name in after}
    assert grew[answer["from"]] == (1, 1, 0) and grew[answer["to"]] == (0, 0, 1), grew
    wait_idle({n: a for n, a in server.workers.items()}, limit_s=10)


@pytest.mark.parametrize("deployment", ["nixl"], indirect=True)
def test_replay_moves_and_refusals(deployment):
    _, server = deployment
    base = server.base_url
    model = openai.OpenAI(base_url=server.openai_url, api_key="unused").models.list().data[0].id
    body = _body(model, random_prompt(77, 500), None, CLI_MAX_TOKENS)
    unmoved, _, _ = asyncio.run(_stream(base, body))

    async def replay(request_id: str) -> dict:
        listed = json.loads(await _admin(base, "requests"))          # `splitserve admin requests`
        assert [r["request_id"] for r in listed] == [request_id], listed
        async with httpx.AsyncClient(timeout=60) as client:
            to = "decode-1" if listed[0]["worker"] == "decode-0" else "decode-0"
            reply = await client.post(f"{base}/admin/migrate", json={"request_id": request_id, "to": to,
                                                                     "method": "replay"})
            assert reply.status_code == 200, reply.text
            return {**reply.json(), "asked": to}

    moved, _, answer = asyncio.run(_stream(base, body, replay))
    assert moved == unmoved
    assert answer["method"] == "replay" and answer["to"] == answer["asked"], answer
    assert answer["replay_reason"] == "token replay was asked for"

    with httpx.Client(timeout=10) as client:
        unknown = client.post(f"{base}/admin/migrate", json={"request_id": "cmpl-nope"})
        assert unknown.status_code == 404 and "cmpl-nope" in unknown.json()["error"]["message"]
        bad = client.post(f"{base}/admin/migrate", json={"request_id": "x", "method": "teleport"})
        assert bad.status_code == 400, bad.text

    async def to_nowhere(request_id: str) -> int:
        async with httpx.AsyncClient(timeout=60) as client:
            reply = await client.post(f"{base}/admin/migrate", json={"request_id": request_id, "to": "decode-9"})
            assert "not a ready decode worker" in reply.json()["error"]["message"], reply.text
            return reply.status_code

    still, _, status = asyncio.run(_stream(base, body, to_nowhere))
    assert status == 400 and still == unmoved
    wait_idle({n: a for n, a in server.workers.items()}, limit_s=10)
