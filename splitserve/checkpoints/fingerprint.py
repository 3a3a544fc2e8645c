"""A worker's compatibility fingerprint: what must be equal for two workers to exchange KV.

Two workers can hand KV to each other only if the KV one computes is the KV the other would have
computed: the same weights (not only the same model name: a rolling update may change the weights
under one name), the same tokenizer and chat template (token ids must mean the same), and the same
engine (its kernels and KV conventions). The fingerprint names those three as short digests:

    weights=3f2a9c0e5b7d1a48 tokenizer=91c0d2e4f6a8b0c2 engine=builtin/0.1.0

It goes into the transfer layout (`KVLayout.fingerprint`, hashed with the geometry), so the
router pairs a prefill and a decode worker only when their layout hashes are equal, a sender's
handshake refuses a receiver with another one, and a receiver refuses a sender's connection or
notification that names another layout hash. The dtype, KV geometry, block size and layout are
already fields of the layout; the tensor-parallel degree deliberately is not (ranks of different
degree exchange head slices: kvtransfer/tp_slicing.py).

The weights digest is xxh3-128 over the checkpoint's weight and config files in name order. A
file of a Hugging Face hub snapshot is a link to a blob named by its content hash: that name is
used instead of reading the file. Other files are read once and the digest is kept in
`<cache>/fingerprints.json` under the file's path, size and modification time, so a restart does
not read them again. `SPLITSERVE_WEIGHTS_REVISION=TEXT` names the weights instead (a revision,
a release tag): nothing is read, and workers pair only with workers naming the same text.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import xxhash

log = logging.getLogger(__name__)

REVISION_ENV = "SPLITSERVE_WEIGHTS_REVISION"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CONFIG_FILES = ("config.json",)                 # what shapes the model besides its weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json")
_HUB_BLOB = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?$")   # git sha-1 or LFS sha-256
_CHUNK = 16 << 20
_PROGRESS_S = 5.0


@dataclass(frozen=True, slots=True)
class Fingerprint:
    weights: str                # digest of the weights (or the revision SPLITSERVE_WEIGHTS_REVISION names)
    tokenizer: str              # digest of the tokenizer and its config (chat template included)
    engine: str                 # "builtin/<splitserve version>", "vllm/<vLLM version>"

    def text(self) -> str:
        return f"weights={self.weights} tokenizer={self.tokenizer} engine={self.engine}"


def parse(text: str) -> dict[str, str]:
    """The parts of a `Fingerprint.text()`; {} for "" (a worker from before fingerprints)."""
    return dict(part.split("=", 1) for part in text.split() if "=" in part)


def differences(local: str, peer: str) -> str:
    """What differs between two fingerprint texts, for a refusal message."""
    mine, theirs = parse(local), parse(peer)
    if not theirs or not mine:
        return f"local {local or 'none'!r} vs peer {peer or 'none (a worker from before fingerprints)'!r}"
    return ", ".join(f"{part} {mine.get(part, '?')} here vs {theirs.get(part, '?')} on the peer"
                     for part in sorted(set(mine) | set(theirs)) if mine.get(part) != theirs.get(part))


def named_revision(revision: str = "") -> str:
    """The weights' identity as named: `revision`, else SPLITSERVE_WEIGHTS_REVISION; "" when neither."""
    named = revision.strip() or os.environ.get(REVISION_ENV, "").strip()
    return "rev:" + re.sub(r"\s+", "_", named) if named else ""


def default_cache_file() -> Path:
    """Where the digests of files already read are kept (model_source.default_cache_dir)."""
    from splitserve.checkpoints.model_source import default_cache_dir

    return default_cache_dir() / "fingerprints.json"


def weights_digest(source: str | Path, cache_file: Path | None = None, revision: str = "") -> str:
    """The weights' identity: `named_revision`, else the digest of the checkpoint's files at
    `source` (a folder or one file)."""
    named = named_revision(revision)
    if named:
        return named
    path = Path(source)
    if not path.exists():
        return "none"
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name in CONFIG_FILES))
    if not files:
        return "none"
    cache = _Cache(cache_file)
    total = xxhash.xxh3_128()
    for file in files:
        total.update(file.name.encode() + b"\x00" + _file_digest(file, cache).encode() + b"\x00")
    cache.save()
    return total.hexdigest()[:16]


def checkpoint_fingerprint(source: str | Path, tokenizer_json: str, tokenizer_config: dict,
                           engine: str, revision: str = "") -> Fingerprint:
    """The fingerprint of a worker serving the checkpoint at `source` with `engine` (its weights
    named `revision`, when given)."""
    return Fingerprint(weights_digest(source, default_cache_file(), revision),
                       tokenizer_digest(tokenizer_json, tokenizer_config), engine)


def folder_tokenizer_digest(folder: str | Path) -> str:
    """`tokenizer_digest` of a Hugging Face folder's tokenizer files (any that exist)."""
    h = xxhash.xxh3_128()
    path = Path(folder)
    for name in TOKENIZER_FILES:
        file = path / name
        if file.is_file():
            h.update(name.encode() + b"\x00" + file.read_bytes() + b"\x00")
    return h.hexdigest()[:16]


def tokenizer_digest(tokenizer_json: str, tokenizer_config: dict) -> str:
    h = xxhash.xxh3_128(tokenizer_json.encode())
    h.update(json.dumps(tokenizer_config, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def _file_digest(file: Path, cache: _Cache) -> str:
    if file.is_symlink():
        blob = os.path.basename(os.readlink(file))
        if _HUB_BLOB.match(blob):
            return "hub:" + blob                 # the hub named the blob by its content
    stat = file.stat()
    key = str(file.resolve())
    known = cache.get(key, stat.st_size, stat.st_mtime_ns)
    if known is not None:
        return known
    digest = _read_digest(file, stat.st_size)
    cache.put(key, stat.st_size, stat.st_mtime_ns, digest)
    return digest


def _read_digest(file: Path, size: int) -> str:
    h = xxhash.xxh3_128()
    done, said = 0, time.monotonic()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            done += len(chunk)
            if time.monotonic() - said > _PROGRESS_S:
                said = time.monotonic()
                log.info("fingerprinting %s: %.1f of %.1f GiB", file.name, done / 2**30, size / 2**30)
    return h.hexdigest()


class _Cache:
    """Digests of files already read, by (path, size, mtime); a damaged cache is started afresh."""

    def __init__(self, path: Path | None):
        self.path = path
        self.entries: dict[str, dict] = {}
        self.changed = False
        if path is not None and path.is_file():
            try:
                self.entries = json.loads(path.read_text())
            except (OSError, ValueError):
                self.entries = {}

    def get(self, key: str, size: int, mtime_ns: int) -> str | None:
        entry = self.entries.get(key)
        if isinstance(entry, dict) and entry.get("size") == size and entry.get("mtime_ns") == mtime_ns:
            return entry.get("digest")
        return None

    def put(self, key: str, size: int, mtime_ns: int, digest: str) -> None:
        self.entries[key] = {"size": size, "mtime_ns": mtime_ns, "digest": digest}
        self.changed = True

    def save(self) -> None:
        if self.path is None or not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.entries))
            tmp.replace(self.path)               # atomic: workers starting together each write whole files
        except OSError as error:
            log.warning("cannot keep weight digests in %s: %s", self.path, error)
