"""The local-disk tier: one file per KV block under `--kv-disk-path`, written behind the engine.

Blocks the host tier evicts are queued here and written by one background thread (a temporary
file, then a rename, so a reader never sees half a block under the final name); deletions go
through the same queue, in order. Until its write lands a block is served from the queue. The
index (which hashes are here, LRU order, bytes used) lives in memory and starts empty: files of
an earlier run are not trusted to be this run's.

A read verifies the frame (block_codec): a truncated, corrupt or foreign file is deleted and
BlockRejected raised (the caller counts the reason), and the block is recomputed. A write that fails (a full disk, an I/O
error) is counted and the block dropped; `take_dropped` hands such hashes to the caller so the
router hears that they are gone. The fault switch (kvtransfer/faults.py, site `disk`) flips a bit
of a block's file or leaves the file unwritten; its read is then rejected as above.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
from collections import Counter, OrderedDict
from pathlib import Path

from splitserve.kvtransfer.block_codec import BlockRejected, HEADER, decode, encode_header
from splitserve.kvtransfer.faults import FaultSwitch, flip_bit

log = logging.getLogger(__name__)


class DiskTier:
    name = "disk"

    def __init__(self, path: str | Path, capacity_bytes: int, layout: bytes, block_bytes: int,
                 faults: FaultSwitch | None = None):
        self.dir = Path(path)
        self.faults = faults if faults is not None else FaultSwitch.from_env()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.layout = layout
        self.block_bytes = block_bytes
        self.file_bytes = HEADER.size + block_bytes
        self.capacity_blocks = capacity_bytes // self.file_bytes
        self.entries: OrderedDict[bytes, None] = OrderedDict()       # LRU first
        self.write_failures: Counter[str] = Counter()                 # reason -> blocks whose write failed
        self.bytes_written = 0
        self._pending: dict[bytes, bytes] = {}                        # hash -> payload not yet on disk
        self._dropped: list[bytes] = []
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, bytes] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def file_of(self, block_hash: bytes) -> Path:
        return self.dir / f"{block_hash.hex()}.kvb"

    # -- writes (behind the engine) ----------------------------------------------------
    def put(self, block_hash: bytes, payload: bytes, keep: frozenset[bytes] = frozenset()) -> list[bytes]:
        """Queue a block for writing; returns the hashes evicted to make room (least recently used
        first, except those in `keep`; if only those are left, this block is not kept)."""
        if not self.capacity_blocks or len(payload) != self.block_bytes:
            return []
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return []
        evicted = []
        while len(self.entries) >= self.capacity_blocks:
            old = next((h for h in self.entries if h not in keep), None)
            if old is None:
                return evicted
            del self.entries[old]
            self._forget(old)
            evicted.append(old)
        self.entries[block_hash] = None
        with self._lock:
            self._pending[block_hash] = payload
        self._queue.put(("write", block_hash))
        return evicted

    def _forget(self, block_hash: bytes) -> None:
        with self._lock:
            self._pending.pop(block_hash, None)
        self._queue.put(("delete", block_hash))

    def _write_loop(self) -> None:
        while (op := self._queue.get()) is not None:
            try:
                self._run(*op)
            finally:
                self._queue.task_done()

    def _run(self, kind: str, block_hash: bytes) -> None:
        path = self.file_of(block_hash)
        if kind == "delete":
            path.unlink(missing_ok=True)
            return
        with self._lock:
            payload = self._pending.get(block_hash)
        if payload is None:
            return                                # evicted before its turn
        fault = self.faults.hit("disk", f"disk block {block_hash.hex()[:12]}")
        if fault != "drop":                       # an injected drop: the entry stays, its read fails
            self._write(block_hash, path, payload, flip=fault == "flip")
        with self._lock:
            self._pending.pop(block_hash, None)

    def _write(self, block_hash: bytes, path: Path, payload: bytes, flip: bool) -> None:
        """The block's file (a temporary one, then a rename); a failed write is counted and dropped."""
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(encode_header(self.layout, payload))
                if flip:                          # the fault switch's disk=flip, after the checksum
                    payload = bytearray(payload)
                    flip_bit(payload)
                f.write(payload)
            os.replace(tmp, path)
            self.bytes_written += self.file_bytes
        except OSError as exc:
            reason = "disk_full" if exc.errno == errno.ENOSPC else "io_error"
            log.warning("KV disk tier: writing a block failed (%s); it will be recomputed", exc)
            tmp.unlink(missing_ok=True)
            with self._lock:
                self.write_failures[reason] += 1
                self._dropped.append(block_hash)

    def take_dropped(self) -> list[bytes]:
        """Hashes whose write failed since the last call (the caller forgets them and says so)."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
        for h in dropped:
            self.entries.pop(h, None)
        return dropped

    # -- reads ---------------------------------------------------------------------------
    def get(self, block_hash: bytes) -> memoryview | bytes | None:
        """The block's payload, or None (not here); raises BlockRejected after dropping a bad file."""
        if block_hash not in self.entries:
            return None
        with self._lock:
            payload = self._pending.get(block_hash)
        if payload is not None:
            self.entries.move_to_end(block_hash)
            return payload
        try:
            data = self.file_of(block_hash).read_bytes()
            payload = decode(data, self.layout, self.block_bytes)
        except OSError as exc:
            self._reject(block_hash)
            raise BlockRejected("io_error", str(exc)) from None
        except BlockRejected:
            self._reject(block_hash)
            raise
        self.entries.move_to_end(block_hash)
        return payload

    def _reject(self, block_hash: bytes) -> None:
        """Forget a block whose file failed its read; the caller counts the reason."""
        self.entries.pop(block_hash, None)
        self._forget(block_hash)

    def discard(self, block_hash: bytes) -> bool:
        if block_hash not in self.entries:
            return False
        del self.entries[block_hash]
        self._forget(block_hash)
        return True

    def clear(self) -> list[bytes]:
        hashes = list(self.entries)
        for h in hashes:
            self.discard(h)
        return hashes

    def flush(self) -> None:
        """Wait until every queued write and deletion has landed (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)        # after the queued work: what was accepted is written
        self._writer.join(timeout=10)
