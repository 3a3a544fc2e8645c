"""KV tiers below the pool (host memory, local disk) on a real engine: greedy output is
token-exact with tiers on and off, prefixes come back from the tier that holds them, and a
block that fails its check (corrupt, truncated, foreign) is recomputed, never used.

The pool holds one request (6 blocks: a prompt of 5 full blocks and its tail), so running B
after A evicts all of A's cached blocks, which the tiers keep; running A again loads them back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from splitserve.errors import InvalidRequestError
from splitserve.block_hashes import block_hashes
from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.engine_api.kv_events import BlockRemoved, BlockStored
from splitserve.kvtransfer.block_codec import HEADER
from splitserve.services.worker_protocol.sampling_params import SamplingParams

BLOCK = 16
PROMPTS = {name: [(seed * 97 + i * 13) % 1000 + 3 for i in range(5 * BLOCK + 3)]
           for seed, name in enumerate("AB", start=1)}
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _engine(model_dir, **tiers) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=6,
                                  block_size=BLOCK, max_num_batched_tokens=256, **tiers))


def _run(engine, name: str) -> list[int]:
    [result] = engine.generate([PROMPTS[name]], GREEDY)
    return result.token_ids


@pytest.fixture(scope="module")
def reference(llama_dir) -> dict[str, list[int]]:
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=64,
                                    block_size=BLOCK, enable_prefix_caching=False))
    try:
        return {name: _run(engine, name) for name in PROMPTS}
    finally:
        engine.close()


def _a_hashes(engine) -> list[bytes]:
    return block_hashes(PROMPTS["A"], BLOCK, engine.scheduler.extra_key)


def _evict_a(engine, reference) -> None:
    """Run A, then B, whose blocks evict all of A's; both outputs exact."""
    assert _run(engine, "A") == reference["A"]
    assert _run(engine, "B") == reference["B"]
    assert not any(h in engine.pool.cached for h in _a_hashes(engine))


def _cycle(engine, reference) -> None:
    _evict_a(engine, reference)
    assert _run(engine, "A") == reference["A"]


def _block_bytes(engine) -> int:
    return engine.tiers.block_bytes


def test_host_tier_serves_an_evicted_prefix_token_exact(llama_dir, reference):
    engine = _engine(llama_dir, kv_host_gib=0.01)
    try:
        engine.take_events()
        _cycle(engine, reference)
        stats = engine.tiers.stats
        assert stats.hits["host"] == 5            # A's five full blocks, loaded back
        assert engine.scheduler.num_tier_hit_tokens == 5 * BLOCK
        events = engine.take_events()
        host_stored = [h for e in events if isinstance(e, BlockStored) and e.tier == "host" for h in e.block_hashes]
        device_removed = [h for e in events if isinstance(e, BlockRemoved) and e.tier == "device"
                          for h in e.block_hashes]
        assert set(device_removed) <= set(host_stored) and len(host_stored) >= 5
    finally:
        engine.close()


def test_without_tiers_the_evicted_prefix_is_recomputed(llama_dir, reference):
    engine = _engine(llama_dir)
    try:
        _cycle(engine, reference)
        assert engine.tiers is None and engine.scheduler.num_tier_hit_tokens == 0
    finally:
        engine.close()


def test_disk_tier_serves_an_evicted_prefix_token_exact(llama_dir, reference, tmp_path):
    engine = _engine(llama_dir, kv_disk_gib=0.05, kv_disk_path=str(tmp_path))
    try:
        _evict_a(engine, reference)
        engine.tiers.disk.flush()
        files = sorted(tmp_path.glob("*.kvb"))
        assert len(files) >= 5
        assert all(f.stat().st_size == HEADER.size + _block_bytes(engine) for f in files)
        assert _run(engine, "A") == reference["A"]
        assert engine.tiers.stats.hits["disk"] == 5
    finally:
        engine.close()


def _damage_first_block_of_a(engine, tmp_path, how: str) -> None:
    engine.tiers.disk.flush()
    second = block_hashes(PROMPTS["A"], BLOCK, engine.scheduler.extra_key)[1]
    path = engine.tiers.disk.file_of(second)
    data = bytearray(path.read_bytes())
    if how == "corrupt":
        data[HEADER.size + 100] ^= 0xFF
    elif how == "truncated":
        data = data[:len(data) // 2]
    elif how == "foreign_layout":
        data[8:24] = bytes(16)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["corrupt", "truncated", "foreign_layout"])
def test_a_damaged_disk_block_is_recomputed_token_exact(llama_dir, reference, tmp_path, how):
    engine = _engine(llama_dir, kv_disk_gib=0.05, kv_disk_path=str(tmp_path))
    try:
        _evict_a(engine, reference)
        _damage_first_block_of_a(engine, tmp_path, how)
        assert _run(engine, "A") == reference["A"]
        stats = engine.tiers.stats
        assert stats.rejected[how] == 1
        assert stats.hits["disk"] == 1                # the block before the damaged one only
    finally:
        engine.close()


def test_a_corrupted_host_block_is_recomputed(llama_dir, reference):
    engine = _engine(llama_dir, kv_host_gib=0.01)
    try:
        _evict_a(engine, reference)
        host = engine.tiers.host
        host.slots[host.entries[_a_hashes(engine)[1]].slot].view(-1)[7] += 1.0     # A's second block
        assert _run(engine, "A") == reference["A"]
        assert engine.tiers.stats.rejected["corrupt"] == 1
        assert engine.tiers.stats.hits["host"] == 1          # the block before it
    finally:
        engine.close()


def test_tier_settings_are_checked(llama_dir):
    with pytest.raises(InvalidRequestError, match="needs --kv-disk-path"):
        _engine(llama_dir, kv_disk_gib=1.0)
    with pytest.raises(InvalidRequestError, match=">= 0"):
        _engine(llama_dir, kv_host_gib=-1.0)


FULL_DISK_CHILD = """
import json, sys
from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.worker_protocol.sampling_params import SamplingParams
model, disk, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
engine = LLMEngine(EngineConfig(model=model, dtype="float32", num_kv_blocks=6, block_size=16,
                                kv_disk_gib=0.05, kv_disk_path=disk))
run = lambda p: engine.generate([p], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
out = [run(prompts["A"]), run(prompts["B"])]
engine.tiers.disk.flush()
out.append(run(prompts["A"]))
engine.tiers.disk.flush()
files = sorted(p.name for p in engine.tiers.disk.dir.iterdir())
print(json.dumps({"out": out, "write_failures": dict(engine.tiers.disk.write_failures),
                  "disk_hits": engine.tiers.stats.hits["disk"], "files": files}))
engine.close()
"""


def test_a_full_disk_drops_blocks_and_recomputes_token_exact(llama_dir, reference, tmp_path):
    """A real full filesystem (a 64 KiB tmpfs, mounted in a private mount namespace): the first
    block file fits, the next writes fail with ENOSPC; those blocks are dropped and counted (A's
    other four, then B's five, which A's rerun evicts), and A's rerun loads its first block and
    recomputes what the disk could not keep."""
    assert shutil.which("unshare"), "util-linux's unshare is needed (the Ray tests use it too)"
    disk = tmp_path / "small-disk"
    disk.mkdir()
    script = (f"mount -t tmpfs -o size=64k tmpfs {disk} && "
              f"exec {sys.executable} -c \"$CHILD\" {llama_dir} {disk} '{json.dumps(PROMPTS)}'")
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                          env={**os.environ, "CHILD": FULL_DISK_CHILD},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["out"] == [reference["A"], reference["B"], reference["A"]]
    assert result["write_failures"] == {"disk_full": 9}
    assert result["disk_hits"] == 1 and len(result["files"]) == 1 and result["files"][0].endswith(".kvb")


@pytest.mark.parametrize("fault, tier, reason", [("host=flip", "host", "corrupt"), ("disk=flip", "disk", "corrupt"),
                                                 ("disk=drop", "disk", "io_error")])
def test_the_fault_switch_damages_every_tier_block_and_none_reaches_a_token(llama_dir, reference, tmp_path,
                                                                          monkeypatch, fault, tier, reason):
    """SPLITSERVE_KV_FAULTS (kvtransfer/faults.py) at rate 1: every block the tier keeps is damaged;
    loading A's prefix back meets its first block, rejects it and recomputes: token-exact."""
    monkeypatch.setenv("SPLITSERVE_KV_FAULTS", fault)
    tiers = {"kv_host_gib": 0.01} if tier == "host" else {"kv_disk_gib": 0.05, "kv_disk_path": str(tmp_path)}
    engine = _engine(llama_dir, **tiers)
    try:
        _evict_a(engine, reference)
        if tier == "disk":
            engine.tiers.disk.flush()
        damaged = getattr(engine.tiers, tier).faults.injected[tier]
        assert damaged >= 5                                   # A's five full blocks at least
        assert _run(engine, "A") == reference["A"]
        stats = engine.tiers.stats
        assert stats.rejected[reason] == 1 and stats.hits[tier] == 0
        assert engine.tiers.rejections()[reason] == 1
    finally:
        engine.close()
