"""`VllmKVEvents` on a real vLLM: the events a real in-process `LLMEngine` publishes come out with
splitserve's block hashes, exactly what the router computes for the same prompts.

kv_events_probe.py runs in the vLLM engine's environment (a subprocess: vLLM does not install
beside splitserve's test dependencies) and prints the translated events of each phase.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from splitserve.block_hashes import block_hashes, salted_key
from splitserve.services.engine_vllm.environment import BASE_ENV

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm")]

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def probe(vllm_python, vllm_model_dir, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("kv-events")
    env = os.environ | BASE_ENV | {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    done = subprocess.run([vllm_python, str(HERE / "kv_events_probe.py"), str(vllm_model_dir), str(work)],
                          env=env, capture_output=True, text=True, timeout=600, check=False, cwd=work)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("PROBE-RESULT ")), None)
    assert done.returncode == 0 and line, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(line.removeprefix("PROBE-RESULT "))


def stored(events: list[dict]) -> list[dict]:
    return [e for e in events if e["kind"] == "stored"]


def chain(probe: dict, prompt: list[int], output: list[int], salt: str = "") -> list[str]:
    """The router's hashes for a sequence's full blocks (prompt and output: vLLM caches both)."""
    key = salted_key(bytes.fromhex(probe["extra_key"]), salt)
    return [h.hex() for h in block_hashes(prompt + output, probe["block_size"], key)]


def check_stored_chain(probe: dict, events: list[dict], expected: list[str], tokens: list[int]) -> None:
    """The events store a run of `expected`, each with its parent and its block's token ids."""
    bs = probe["block_size"]
    for e in events:
        first = expected.index(e["hashes"][0])
        assert e["hashes"] == expected[first:first + len(e["hashes"])]
        assert e["parent"] == (expected[first - 1] if first else None)
        assert e["tokens"] == tokens[first * bs:(first + len(e["hashes"])) * bs]
        assert e["tier"] == "device"


def test_events_are_numbered_from_one_without_gaps(probe):
    seqs = [e["seq"] for phase in probe["phases"].values() for e in phase]
    assert seqs == list(range(1, len(seqs) + 1))
    assert probe["num_resyncs"] == 0 and probe["num_dropped_blocks"] == 0 and probe["woken"]


def test_batches_published_before_the_subscriber_come_back_by_replay(probe):
    """The "late" request ran before `start()`: its blocks still arrive, in order, first."""
    prompt, out = probe["prompts"]["late"], probe["outputs"]["late"]
    expected = chain(probe, prompt, out)
    first = stored(probe["phases"]["late"])[0]
    assert len(prompt) // probe["block_size"] <= len(first["hashes"]) <= len(expected)
    check_stored_chain(probe, [first], expected, prompt + out)


def test_a_shared_prefix_hashes_as_the_router_hashes_it(probe):
    bs = probe["block_size"]
    a, b = probe["prompts"]["shared_a"], probe["prompts"]["shared_b"]
    chain_a = chain(probe, a, probe["outputs"]["shared_a"])
    chain_b = chain(probe, b, probe["outputs"]["shared_b"])
    num_shared = next(i for i in range(len(a)) if a[i] != b[i]) // bs
    assert num_shared >= 3 and chain_a[:num_shared] == chain_b[:num_shared]
    a_events = stored(probe["phases"]["late"])[1:]          # after the late request's replayed blocks
    b_events = stored(probe["phases"]["shared"])
    check_stored_chain(probe, a_events, chain_a, a + probe["outputs"]["shared_a"])
    assert [h for e in a_events for h in e["hashes"]][:len(a) // bs] == chain_a[:len(a) // bs]
    # b reuses a's prefix: only its own blocks are stored, chained onto the shared ones
    check_stored_chain(probe, b_events, chain_b, b + probe["outputs"]["shared_b"])
    assert b_events[0]["hashes"][0] == chain_b[num_shared] and b_events[0]["parent"] == chain_a[num_shared - 1]


def test_a_salted_prompt_hashes_with_the_salted_key(probe):
    """Every block of a salted prompt is keyed by the salt, also those of a later event (the prompt's
    last block, filled while decoding), whose vLLM extra keys no longer carry the salt."""
    a, out = probe["prompts"]["salted"], probe["outputs"]["salted"]
    salted = chain(probe, a, out, salt="tenant-7")
    events = stored(probe["phases"]["salted"])
    check_stored_chain(probe, events, salted, a + out)
    hashes = [h for e in events for h in e["hashes"]]
    assert hashes == salted and len(hashes) > len(a) // probe["block_size"]
    assert len(events) >= 2 and events[-1]["parent"] is not None
    assert not set(hashes) & set(chain(probe, a, out))          # apart from the unsalted blocks


def test_evicted_blocks_are_removed_by_their_splitserve_hash(probe):
    published: set[str] = set()
    for name in ("late", "shared", "salted"):
        published |= {h for e in stored(probe["phases"][name]) for h in e["hashes"]}
    live = set(published)
    removed = []
    for e in probe["phases"]["evict"]:
        if e["kind"] == "stored":
            live |= set(e["hashes"])
            published |= set(e["hashes"])
        else:
            assert e["kind"] == "removed" and set(e["hashes"]) <= live, "a removal of a block never stored"
            live -= set(e["hashes"])
            removed += e["hashes"]
    assert removed and set(removed) & set(chain(probe, probe["prompts"]["late"], probe["outputs"]["late"]))


def test_a_prefix_cache_reset_is_an_all_cleared(probe):
    assert [e["kind"] for e in probe["phases"]["reset"]] == ["cleared"]


def test_a_gap_without_replay_resyncs_with_an_all_cleared(probe):
    """A subscriber that joined late and cannot replay tells the router to forget, then goes on."""
    events = probe["no_replay"]["events"]
    assert probe["no_replay"]["num_resyncs"] == 1
    assert events[0]["kind"] == "cleared" and [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert stored(events)[0]["hashes"] == stored(probe["phases"]["late"])[1]["hashes"]


def test_preemptions_are_counted_as_vllm_counts_them(probe):
    """stat_counts.py: vLLM reports a preemption only in its per-step stats; the worker's logger
    counts them (Stats.num_preemptions, splitserve_worker_preemptions_total) as vLLM's own
    Prometheus counter does."""
    preempt = probe["preempt"]
    assert preempt["lengths"] == [150] * 4                   # preempted, recomputed, finished
    assert preempt["counted"] > 0
    assert preempt["total"] == preempt["vllm_counter"]
