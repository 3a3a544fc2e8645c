"""NIXL backend: UCX one-sided WRITEs straight into the receiver's registered pool.

Shaped by what DESIGN section 5 measured on these machines:

- The progress thread is off (`enable_prog_thread=False`); the connector drives
  UCX itself whenever it is polled (`check_xfer_state` on the sender,
  `get_new_notifs` on the receiver). That measured 3× faster than the thread on
  2 cores; the price is that an owner must keep polling (`wait*` does).
- The pool is registered (DRAM, or VRAM for CUDA tensors) in `register()`,
  before `metadata()` can be called, because a peer that loads metadata taken
  before registration cannot address the pool.
- Each incarnation gets its own NIXL agent name (`name-<incarnation>`), so a
  restarted peer is a different remote agent: `add_peer` with new metadata
  invalidates the old agent (closing its UCX endpoints) and loads the new one;
  a write with the old reservation is refused before it reaches UCX.
- `add_remote_agent` returns the remote name as bytes while notification dicts
  are keyed by str: names are decoded once, here.
- Descriptors: one per contiguous run of blocks that is consecutive on both
  sides (K and V separately); mismatched TP uses one descriptor per token row
  (see tp_slicing.py). The payload-carrying completion notification is a
  standalone NIXL notification sent once all of the request's writes are DONE
  (a DONE WRITE is remotely complete: UCX flushes before reporting it).

Safety: one-sided writes cannot be vetoed by the receiver; see connector.py for
the sender-side checks and the receiver's validation of the notification.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time

import numpy as np
import torch

from .connector import AgentMetadata, Connector, Reservation, TransferHandle
from .errors import PeerLostError, TransferError
from .tp_slicing import HeadSlice, joint_runs, row_descriptors
from .wire import Notification

logger = logging.getLogger(__name__)

_API_MODULES = ("nixl_cu13._api", "nixl_cu12._api", "nixl._api")


def load_nixl_api():
    """The `nixl._api` module, imported from the flavour that is installed (fast path first)."""
    errors = []
    for name in _API_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as error:
            errors.append(f"{name}: {error}")
    raise ImportError("NIXL is not installed (pip install 'splitserve[nixl]'; see scripts/install-test-deps.sh): "
                      + "; ".join(errors))


class _PendingNotify:
    __slots__ = ("handle", "remote", "message", "writes")

    def __init__(self, handle: TransferHandle, remote: str, message: bytes, writes: list[TransferHandle]):
        self.handle, self.remote, self.message, self.writes = handle, remote, message, writes


class NixlConnector(Connector):
    backend = "nixl"

    def __init__(self, name, layout, **kwargs):
        super().__init__(name, layout, **kwargs)
        self._api = load_nixl_api()
        self.agent_name = f"{name}-{self.incarnation[:16]}"
        config = self._api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                             backends=["UCX"])
        self._agent = self._api.nixl_agent(self.agent_name, config)
        self._nixl_lock = threading.RLock()       # the agent runs with thread sync NONE
        self._remote: dict[str, str] = {}         # peer name → loaded NIXL agent name
        self._reg_descs = None
        self._mem_type = "DRAM"
        self._device_id = 0
        self._writes: dict[tuple[str, str], list[TransferHandle]] = {}
        self._notifies: list[_PendingNotify] = []
        self._closed = False

    # -- setup -----------------------------------------------------------------------------
    def _register(self, pool: torch.Tensor) -> None:
        self._mem_type = "VRAM" if pool.is_cuda else "DRAM"
        self._device_id = (pool.device.index or 0) if pool.is_cuda else 0
        with self._nixl_lock:
            self._reg_descs = self._agent.register_memory(pool)

    def metadata(self) -> AgentMetadata:
        pool = self._require_pool()
        bases = tuple(pool[layer].data_ptr() for layer in range(self.layout.num_layers))
        with self._nixl_lock:
            blob = self._agent.get_agent_metadata()
        return AgentMetadata(self.name, self.incarnation, self.backend, "", self.layout,
                             self.layout.layout_hash(), self.num_blocks, bases, str(pool.device), blob)

    def _add_peer(self, meta: AgentMetadata) -> None:
        with self._nixl_lock:
            loaded = self._agent.add_remote_agent(meta.agent_blob)
        self._remote[meta.name] = loaded.decode() if isinstance(loaded, bytes) else loaded

    def _remove_peer(self, meta: AgentMetadata) -> None:
        remote = self._remote.pop(meta.name, None)
        if remote is None:
            return
        with self._nixl_lock:
            try:
                self._agent.remove_remote_agent(remote)
            except Exception as error:      # a dead peer may refuse a clean disconnect
                logger.info("agent %s: removing stale peer %s: %r", self.name, remote, error)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._nixl_lock:
            for remote in list(self._remote.values()):
                try:
                    self._agent.remove_remote_agent(remote)
                except Exception:
                    pass
            self._remote.clear()
            if self._reg_descs is not None:
                try:
                    self._agent.deregister_memory(self._reg_descs)
                except Exception as error:
                    logger.info("agent %s: deregister failed: %r", self.name, error)

    # -- sender side -----------------------------------------------------------------------
    def _descriptors(self, peer: AgentMetadata, layer: int, src: list[int], dst: list[int],
                     hs: HeadSlice) -> tuple[np.ndarray, np.ndarray]:
        lay, plays = self.layout, peer.layout
        src_k = self._require_pool()[layer].data_ptr()
        src_v = src_k + self.num_blocks * lay.block_bytes
        dst_k = peer.layer_base_addrs[layer]
        dst_v = dst_k + peer.num_blocks * plays.block_bytes
        if hs.whole_rows:
            runs = np.asarray(joint_runs(src, dst), dtype=np.int64)
            bb = lay.block_bytes
            lengths = runs[:, 2] * bb
            s = np.concatenate([src_k + runs[:, 0] * bb, src_v + runs[:, 0] * bb])
            d = np.concatenate([dst_k + runs[:, 1] * bb, dst_v + runs[:, 1] * bb])
            lengths = np.concatenate([lengths, lengths])
            return np.stack([s, lengths], 1), np.stack([d, lengths], 1)
        return (row_descriptors(src_k, src_v, src, lay, hs.src_offset, hs.num_heads),
                row_descriptors(dst_k, dst_v, dst, plays, hs.dst_offset, hs.num_heads))

    def _xfer_list(self, rows: np.ndarray, device_id: int):
        table = np.empty((rows.shape[0], 3), dtype=np.uint64)
        table[:, :2] = rows
        table[:, 2] = device_id
        return self._agent.get_xfer_descs(table, self._mem_type)

    def _post_write(self, peer: AgentMetadata, reservation: Reservation, layer: int, src_block_ids: list[int],
                    dst_block_ids: list[int], hs: HeadSlice) -> TransferHandle:
        src_rows, dst_rows = self._descriptors(peer, layer, src_block_ids, dst_block_ids, hs)
        num_bytes = int(src_rows[:, 1].sum())
        handle = self._new_handle(reservation, peer.name, "write", layer, num_bytes)
        remote = self._remote[peer.name]
        peer_device = int(peer.device.split(":")[1]) if ":" in peer.device else 0
        try:
            with self._nixl_lock:
                xfer = self._agent.initialize_xfer("WRITE", self._xfer_list(src_rows, self._device_id),
                                                   self._xfer_list(dst_rows, peer_device), remote, b"")
                state = self._agent.transfer(xfer)
        except Exception as error:
            handle.error = PeerLostError(f"request {reservation.request_id}: posting a write to {peer.name} "
                                         f"failed: {error!r}")
            return handle
        handle.backend_state = xfer
        self._settle(handle, state)
        with self._lock:
            self._writes.setdefault((peer.name, reservation.request_id), []).append(handle)
        return handle

    def _post_notify(self, peer: AgentMetadata, reservation: Reservation, block_ids: tuple[int, ...],
                     payload: bytes) -> TransferHandle:
        message = Notification(reservation.request_id, reservation.incarnation, block_ids, payload).encode()
        handle = self._new_handle(reservation, peer.name, "notify", -1, len(payload))
        with self._lock:
            writes = self._writes.pop((peer.name, reservation.request_id), [])
            self._notifies.append(_PendingNotify(handle, self._remote[peer.name], message, writes))
        self._progress()
        return handle

    def _check(self, handle: TransferHandle) -> None:
        if handle.kind == "notify":
            self._progress()
            return
        xfer = handle.backend_state
        if xfer is None or handle.finished:
            return
        with self._nixl_lock:
            state = self._agent.check_xfer_state(xfer)
        self._settle(handle, state)

    def _settle(self, handle: TransferHandle, state: str) -> None:
        if state == "PROC":
            return
        if state == "DONE":
            handle.done = True
        else:
            handle.error = PeerLostError(f"request {handle.request_id}: write of layer {handle.layer} to "
                                         f"{handle.peer} failed (peer gone?)")
        self._release_xfer(handle)

    def _release_xfer(self, handle: TransferHandle) -> None:
        xfer, handle.backend_state = handle.backend_state, None
        if xfer is None:
            return
        with self._nixl_lock:
            try:
                self._agent.release_xfer_handle(xfer)
            except Exception as error:     # cannot cancel in flight: NIXL frees it at agent teardown
                logger.info("agent %s: releasing a transfer handle: %r", self.name, error)

    def _abandon(self, handle: TransferHandle) -> None:
        if handle.kind == "write":
            self._release_xfer(handle)
        with self._lock:
            self._notifies = [n for n in self._notifies if n.handle is not handle]

    def _wait_once(self, handle: TransferHandle, max_s: float) -> None:
        pass                                 # busy polling: poll() itself drives UCX

    # -- progress: notifications in and out ---------------------------------------------------
    def _progress(self) -> None:
        self._send_ready_notifies()
        with self._nixl_lock:
            notifs = self._agent.get_new_notifs()
        table = self._table
        for sender, messages in notifs.items():
            for raw in messages:
                try:
                    note = Notification.decode(raw)
                    table.complete(note.request_id, note.incarnation, note.block_ids, note.payload)
                except TransferError as error:
                    self._count_failure(type(error))
                    logger.warning("agent %s: refused notification from %s: %s", self.name, sender, error)
                except ValueError as error:
                    logger.warning("agent %s: malformed notification from %s: %s", self.name, sender, error)

    def _send_ready_notifies(self) -> None:
        with self._lock:
            pending, self._notifies = self._notifies, []
        keep = []
        for note in pending:
            for write in note.writes:
                if not write.finished:
                    self._check(write)
            failed = next((w.error for w in note.writes if w.error is not None), None)
            if failed is not None:
                note.handle.error = failed
            elif all(w.done for w in note.writes):
                try:
                    with self._nixl_lock:
                        self._agent.send_notif(note.remote, note.message)
                    note.handle.done = True
                except Exception as error:
                    note.handle.error = PeerLostError(f"request {note.handle.request_id}: notifying "
                                                      f"{note.handle.peer} failed: {error!r}")
            else:
                keep.append(note)
        with self._lock:
            self._notifies.extend(keep)

    def _wait_notification_once(self, max_s: float) -> None:
        time.sleep(min(max_s, 50e-6))       # yield the core briefly; the next poll drives UCX
