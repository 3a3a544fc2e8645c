"""`splitserve serve`, disaggregated, with every protection on at once.

HTTPS for clients, mutual TLS between the frontend and both workers and between
the decode and the prefill worker, an API key, and a transfer token, all from
`serve`'s own flags (secrets reach the children through the environment, never
their command lines). A prompt long enough to be prefilled remotely is served,
and the decode worker's counters show that its KV came from the prefill worker
(over the mutually authenticated Prefill call and the token-checked transfer),
not from a local fallback.
"""

from __future__ import annotations

import re
import ssl
from pathlib import Path

import httpx
import openai
import pytest

from splitserve.net import free_port
from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc
from splitserve.tls import TlsConfig
from splitserve.testing.processes import Proc

API_KEY = "sk-serve-5e7a9c1b3d"
TOKEN = "transfer-secret-8f6d4b2a"
PROMPT_IDS = list(range(100, 300))          # 200 tokens: beyond the 64-token remote-prefill threshold


@pytest.fixture(scope="module")
def served(llama_dir, ca):
    public, internal = ca.issue("frontend"), ca.issue("internal")
    port = free_port()
    proc = Proc.start(["splitserve", "serve", "--model", str(llama_dir), "--port", str(port), "--grpc-port", "0",
                       "--threads", "1", "--kv-cache-gib", "0.05", "--transfer", "tcp",
                       "--tls-cert", str(public.cert), "--tls-key", str(public.key), "--tls-ca", str(ca.ca_path),
                       "--tls-internal-cert", str(internal.cert), "--tls-internal-key", str(internal.key),
                       "--api-key", API_KEY, "--transfer-token", TOKEN])
    try:
        proc.wait_for_line(r"splitserve is ready: https://")
        decode = re.search(r"decode-0 ready .* at (\S+)$", proc.output, re.MULTILINE).group(1)
        yield proc, f"https://127.0.0.1:{port}/v1", decode, internal
    finally:
        if proc.alive():
            proc.process.terminate()
        code = proc.process.wait(60)
    assert code == 0, proc.output[-3000:]
    assert API_KEY not in proc.output and TOKEN not in proc.output


def _children_cmdlines(proc: Proc) -> list[bytes]:
    lines = []
    for pid in proc.children():
        try:
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes())
        except OSError:
            continue         # gone meanwhile
    return lines


def test_served_over_https_with_key_mtls_and_transfer_token(served, ca):
    proc, url, decode, internal = served
    children = _children_cmdlines(proc)
    assert len(children) == 3                           # prefill, decode, frontend
    assert not [c for c in children if API_KEY.encode() in c or TOKEN.encode() in c]
    verify = ssl.create_default_context(cafile=str(ca.ca_path))
    with httpx.Client(verify=verify) as http:
        client = openai.OpenAI(base_url=url, api_key=API_KEY, http_client=http, max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="sk-wrong", http_client=http, max_retries=0).models.list()
    tls = TlsConfig(cert=str(internal.cert), key=str(internal.key), ca=str(ca.ca_path))
    with tls.channel(decode) as channel:
        stats = worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=5)
    assert stats.num_remote_prefills >= 1 and stats.num_prefill_fallbacks == 0, stats
