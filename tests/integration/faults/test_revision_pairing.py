"""Revision-safe pairing (issue 41): a rolling update from weights revision A to revision B under
load, with real workers, etcd and the frontend's router.

Revision B is the random Llama with other K and V projections and output head (its KV and its
tokens differ from A's), served under the same name. A's prefill and decode workers serve; B's
join through etcd; A's drain away (SIGTERM). Throughout, clients stream completions. Every
response must equal A's or B's output for its prompt (never a mix: no B decode over A's KV, no
migration from one revision to the other), with no error. The router never pairs across
revisions (each worker's fingerprint is in its Describe), and when a B decode worker is told
directly to prefill on A's prefill worker, A's handshake refuses and B prefills locally.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import urllib.request
from pathlib import Path

import openai
import pytest

from splitserve.net import free_port
from splitserve.testing.waiting import async_wait_until
from splitserve.testing.workers import generate, worker_stats

from .conftest import DECODE_FLAGS, FRONTEND_FLAGS, expected_outputs, make_jobs, stream_job


def _revision_b(llama_dir: Path, where: Path) -> Path:
    """The same model under the same folder name, with other weights where they shape the KV."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = where / "revision-b" / llama_dir.name
    shutil.copytree(llama_dir, folder)
    for file in folder.glob("*.safetensors"):
        tensors = load_file(file)
        for name in list(tensors):
            if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
                tensors[name] = tensors[name] * 1.5
            elif name == "lm_head.weight":
                tensors[name] = torch.roll(tensors[name], 1, dims=0)
        save_file(tensors, file, metadata={"format": "pt"})
    return folder


def _refusals(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = re.findall(r'^splitserve_kv_transfer_failures_total\{[^}]*reason="layout_mismatch"[^}]*\} ([0-9.e+]+)$',
                       text, re.M)
    return sum(float(v) for v in found)


@pytest.mark.parametrize("transfer", ["tcp", "nixl"])
def test_a_rolling_update_never_mixes_two_weights_revisions(cluster, llama_dir, etcd, tmp_path, transfer):
    cluster.transfer = transfer
    # Prompts over the remote-prefill threshold, each new to every worker until the list wraps.
    jobs = make_jobs(48, seed=41, min_len=80, max_len=140, max_tokens=8)
    revision_b = _revision_b(llama_dir, tmp_path)
    probe_job = make_jobs(1, seed=43, min_len=120, max_len=120, max_tokens=8)[0]   # cached nowhere
    outputs = {"A": expected_outputs(llama_dir, jobs), "B": expected_outputs(revision_b, [*jobs, probe_job])}
    probe_expected = outputs["B"].pop()
    assert all(a != b for a, b in zip(outputs["A"], outputs["B"])), "revision B must answer differently"
    reg = ["--etcd", etcd.endpoint, "--etcd-ttl", "3"]
    ports = {name: free_port() for name in ("p-a", "p-b")}
    p_a = cluster.start_worker("p-a", "prefill", *reg, "--metrics-port", str(ports["p-a"]))
    d_a = cluster.start_worker("d-a", "decode", *DECODE_FLAGS, *reg, "--drain-timeout", "60")
    cluster.wait_workers()
    front = cluster.start_frontend(*FRONTEND_FLAGS, "--etcd", etcd.endpoint, workers=[])
    front.wait_ready(num_workers=2)
    results: list[tuple[int, list[int], str | None]] = []
    refused: dict[str, float] = {}

    async def client(stop: asyncio.Event, offset: int) -> None:
        async with openai.AsyncOpenAI(base_url=front.openai_url, api_key="unused", max_retries=0,
                                      timeout=60) as api:
            i = offset
            while not stop.is_set():
                j = i % len(jobs)
                out = await stream_job(api, jobs[j], [0], 0)
                results.append((j, out.token_ids, out.error))
                i += 3

    def served(revision: str) -> int:
        return sum(error is None and tokens == outputs[revision][j] for j, tokens, error in results)

    async def rolling_update() -> None:
        stop = asyncio.Event()
        clients = [asyncio.create_task(client(stop, k)) for k in range(3)]
        try:
            await async_wait_until(lambda: served("A") >= 3, timeout=120, interval=0.05, what="A serving")
            p_b = cluster.start_worker("p-b", "prefill", *reg, "--model", str(revision_b),
                                       "--metrics-port", str(ports["p-b"]))
            d_b = cluster.start_worker("d-b", "decode", *DECODE_FLAGS, *reg, "--model", str(revision_b))
            await asyncio.to_thread(cluster.wait_workers)
            await asyncio.to_thread(front.wait_ready, 4)
            await async_wait_until(lambda: served("B") >= 3 and worker_stats(d_b.address).num_remote_prefills >= 1,
                                   timeout=120, interval=0.05, what="B serving too, over its own prefill worker")
            # Told directly to prefill on A's prefill worker, B's decode worker is refused and prefills itself.
            probe = await generate(d_b.address, "probe", probe_job.prompt, probe_job.max_tokens,
                                   [("p-a", p_a.address)])
            assert list(probe.token_ids) == probe_expected and not probe.prefilled_remotely
            refused["A"] = await asyncio.to_thread(_refusals, ports["p-a"])
            for worker in (d_a, p_a):                       # A drains away under load
                worker.proc.process.send_signal(signal.SIGTERM)
            for worker in (d_a, p_a):
                assert await asyncio.to_thread(worker.proc.process.wait, 90) == 0, worker.proc.tail()
            after_a = len(results)
            await async_wait_until(lambda: len(results) >= after_a + 6, timeout=120, interval=0.05,
                                   what="B serving alone")
            assert worker_stats(p_b.address).num_prefills_served >= 1
        finally:
            stop.set()
            await asyncio.gather(*clients)

    asyncio.run(rolling_update())
    errors = [error for _, _, error in results if error is not None]
    mixed = [(j, tokens) for j, tokens, error in results
             if error is None and tokens not in (outputs["A"][j], outputs["B"][j])]
    assert not errors, errors[:3]
    assert not mixed, f"{len(mixed)} of {len(results)} responses are neither A's nor B's output: {mixed[:2]}"
    assert served("A") >= 3 and served("B") >= 9
    assert refused["A"] >= 1                             # the probe: tried and refused by A's handshake
    assert _refusals(ports["p-b"]) == 0                  # the router never paired across revisions
    print(f"\n[rolling update {transfer}] responses={len(results)} A={served('A')} B={served('B')} "
          f"refused_pairings={refused['A']:.0f}")
