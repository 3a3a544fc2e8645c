"""`splitserve serve --frontends 2 --router P`: two router replicas on their printed ports, the policy honoured.

Two aggregated workers on a random Llama; each replica must answer a completion
and export its decisions under the policy it was started with. Round-robin
must spread identical prompts over both workers (kv would keep them together).
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from .conftest import Proc, free_port, http_json

READY_TIMEOUT_S = 240


def serve(llama_dir, policy: str) -> tuple[Proc, list[str]]:
    proc = Proc.start(["splitserve", "serve", "--aggregated", "--workers", "2", "--frontends", "2", "--router", policy,
                       "--model", str(llama_dir), "--port", str(free_port()), "--grpc-port", "0",
                       "--threads", "1", "--kv-cache-gib", "0.05"])
    try:
        proc.wait_for_line(r"splitserve is ready", READY_TIMEOUT_S)
    except BaseException:
        proc.stop()
        raise
    bases = []
    for line in proc.lines:
        m = re.search(r"(?:frontend replica|splitserve is ready): (http://\S+)/v1", line)
        if m and m.group(1) not in bases:
            bases.append(m.group(1))
    return proc, bases


def decisions(base: str) -> Counter:
    """(policy, winner) -> decode decisions, from the replica's /metrics."""
    out = Counter()
    for policy, winner, n in re.findall(r'splitserve_router_decisions_total\{leg="decode",policy="([^"]+)",'
                                        r'runner_up="[^"]*",winner="([^"]+)"\} (\S+)', http_json(f"{base}/metrics")):
        out[(policy, winner)] += int(float(n))
    return out


@pytest.mark.parametrize("policy", ["kv", "round-robin"])
def test_two_frontends_answer_and_honour_the_router(llama_dir, policy):
    proc, bases = serve(llama_dir, policy)
    try:
        assert len(bases) == 2, "\n".join(proc.lines)
        prompt = list(range(2000, 2000 + 64))
        for base in bases:
            model = http_json(f"{base}/v1/models")["data"][0]["id"]
            for _ in range(4):
                reply = http_json(f"{base}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 2,
                                                             "temperature": 0}, timeout=60)
                assert reply["choices"][0]["text"] is not None
            counts = decisions(base)
            assert sum(counts.values()) == 4 and {p for p, _ in counts} == {policy}, counts
            if policy == "round-robin":
                assert sorted(counts.values()) == [2, 2], counts        # spread over both workers
    finally:
        proc.stop()
    assert proc.process.returncode == 0, "\n".join(proc.lines[-40:])
