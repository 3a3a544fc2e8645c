"""A worker's compatibility fingerprint (splitserve/checkpoints/fingerprint.py) and what carries it:
the transfer layout's hash and refusal message, and the completion notification's sender layout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from splitserve.checkpoints import fingerprint
from splitserve.kvtransfer.errors import LayoutMismatchError
from splitserve.kvtransfer.frames import Notification
from splitserve.kvtransfer.layout import HASHED_FIELDS, KVLayout
from splitserve.kvtransfer.reservations import ReservationTable


def _checkpoint(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "tokenizer.json").write_text("{}")               # not weights: not in the weights digest
    return folder


@pytest.fixture(autouse=True)
def _no_named_revision(monkeypatch):
    monkeypatch.delenv(fingerprint.REVISION_ENV, raising=False)


def test_the_weights_digest_follows_the_bytes_not_the_name(tmp_path):
    cache = tmp_path / "fingerprints.json"
    a = fingerprint.weights_digest(_checkpoint(tmp_path / "a", b"\x01" * 1000), cache)
    assert fingerprint.weights_digest(_checkpoint(tmp_path / "copy-of-a", b"\x01" * 1000), cache) == a
    assert fingerprint.weights_digest(_checkpoint(tmp_path / "b", b"\x01" * 999 + b"\x02"), cache) != a
    (tmp_path / "a" / "config.json").write_text('{"model_type": "llama", "rope_theta": 1}')
    assert fingerprint.weights_digest(tmp_path / "a", cache) != a          # the config shapes the KV too
    (tmp_path / "a" / "tokenizer.json").write_text('{"x": 1}')
    single = _checkpoint(tmp_path / "gguf", b"") / "m.gguf"
    single.write_bytes(b"GGUF" * 10)
    assert fingerprint.weights_digest(single, cache) != fingerprint.weights_digest(tmp_path / "gguf", cache)


def test_a_file_read_once_is_not_read_again_until_it_changes(tmp_path, monkeypatch):
    cache = tmp_path / "fingerprints.json"
    folder = _checkpoint(tmp_path / "m", b"\x05" * 4096)
    reads: list[str] = []
    real = fingerprint._read_digest
    monkeypatch.setattr(fingerprint, "_read_digest", lambda file, size: reads.append(file.name) or real(file, size))
    first = fingerprint.weights_digest(folder, cache)
    assert sorted(reads) == ["config.json", "model.safetensors"]
    assert fingerprint.weights_digest(folder, cache) == first and len(reads) == 2      # from the cache file
    weights = folder / "model.safetensors"
    weights.write_bytes(b"\x06" * 4096)                         # same size, new modification time
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000))
    assert fingerprint.weights_digest(folder, cache) != first and reads[-1] == "model.safetensors"
    cache.write_text("not json")                                # a damaged cache is started afresh
    assert fingerprint.weights_digest(folder, cache) != first


def test_a_hub_snapshot_is_named_by_its_blobs_without_reading_them(tmp_path, monkeypatch):
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    blob = blobs / ("ab" * 32)                                  # an LFS blob: named by its sha-256
    blob.write_bytes(b"weights")
    snapshot = tmp_path / "snapshots" / "c0ffee"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(blob)
    monkeypatch.setattr(fingerprint, "_read_digest", lambda file, size: pytest.fail(f"{file} was read"))
    assert fingerprint.weights_digest(snapshot, tmp_path / "c.json") != fingerprint.weights_digest(tmp_path / "none")


def test_a_named_revision_replaces_the_digest(tmp_path, monkeypatch):
    monkeypatch.setenv(fingerprint.REVISION_ENV, "release 2026-12")
    assert fingerprint.weights_digest(tmp_path / "anything") == "rev:release_2026-12"


def test_a_layout_without_a_fingerprint_hashes_as_before_and_a_fingerprint_changes_the_hash():
    layout = KVLayout(model="m|", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8, block_size=16)
    import hashlib
    before = hashlib.sha256()
    for name in HASHED_FIELDS[:-1]:                             # the fields before fingerprints existed
        before.update(f"{name}={getattr(layout, name)}".encode() + b"\x00")
    assert HASHED_FIELDS[-1] == "fingerprint" and layout.layout_hash() == before.hexdigest()
    a = KVLayout(**{**_fields(layout), "fingerprint": "weights=aaaa tokenizer=tt engine=builtin/0.1.0"})
    b = KVLayout(**{**_fields(layout), "fingerprint": "weights=bbbb tokenizer=tt engine=builtin/0.1.0"})
    assert len({layout.layout_hash(), a.layout_hash(), b.layout_hash()}) == 3
    assert a.describe_mismatch(b) == "fingerprint: weights aaaa here vs bbbb on the peer"
    assert "from before fingerprints" in a.describe_mismatch(layout)
    assert a.with_tp(1, 2).layout_hash() == a.layout_hash()          # TP degree is still not part of it


def _fields(layout: KVLayout) -> dict:
    return {name: getattr(layout, name) for name in layout.__dataclass_fields__}


def test_a_notification_names_its_senders_layout_and_earlier_ones_still_decode():
    note = Notification("r", "inc", (1, 2), b"payload", "f" * 64)
    assert Notification.decode(note.encode()) == note
    earlier = Notification("r", "inc", (1, 2), b"payload")
    assert Notification.decode(earlier.encode()).sender_layout == ""


def test_a_refused_notification_fails_its_request_at_once():
    table = ReservationTable(8, "inc")
    table.reserve("r", [1, 2], ttl_s=10)
    with pytest.raises(LayoutMismatchError):
        table.refuse("r", "inc", LayoutMismatchError("another weights revision wrote it"))
    with pytest.raises(LayoutMismatchError, match="another weights revision"):
        table.take_result("r")


def test_a_revision_given_by_the_caller_wins_over_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(fingerprint.REVISION_ENV, "from-env")
    assert fingerprint.weights_digest(tmp_path, revision="from-spec") == "rev:from-spec"
    assert fingerprint.weights_digest(tmp_path) == "rev:from-env"


def test_the_engine_publishes_its_fingerprint_in_describe_and_in_its_transfer_layout(llama_dir):
    from splitserve.services.engine.builtin import BuiltinEngine, kv_layout
    from splitserve.services.engine.config import EngineConfig
    from splitserve.services.engine.engine import LLMEngine

    digested = BuiltinEngine(LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=16, num_threads=1)))
    named = BuiltinEngine(LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=16, num_threads=1,
                                                 weights_revision="r7")))
    try:
        text = digested.describe().fingerprint
        parts = fingerprint.parse(text)
        assert set(parts) == {"weights", "tokenizer", "engine"} and parts["engine"].startswith("builtin/")
        assert kv_layout(digested.core).fingerprint == text
        assert fingerprint.parse(named.describe().fingerprint)["weights"] == "rev:r7"
        assert kv_layout(named.core).layout_hash() != kv_layout(digested.core).layout_hash()
    finally:
        digested.close()
        named.close()
