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
- Descriptors are prepared once and reused: per layer, one local descriptor
  list (`prep_xfer_dlist(NIXL_INIT_AGENT)`) and, per remote agent, one remote
  list, each with `2 * num_blocks` descriptors of `block_bytes` from the layer's
  base: K blocks then V blocks (layer-major), or each block's page as two halves
  (paged; tp_slicing.block_rows). A write is `make_prepped_xfer` with those
  indices: no descriptor validation or lookup per write (`initialize_xfer` with
  fresh lists costs that on every call). Coalescing: NIXL's makeXferReq merges
  indices whose descriptors are adjacent in memory on both sides into one
  descriptor, so a run of consecutive blocks on both sides (tp_slicing.run_arrays)
  moves as one UCX put per K/V (layer-major) or one put (paged, whose page halves
  are adjacent).
  `coalesce=False` passes `skip_desc_merge` (one put per descriptor, for comparison).
  Building our own run descriptors instead (`initialize_xfer`, one descriptor
  per run) measured 5-10x the per-write cost (300-500 us vs 30-60 us for 1024
  blocks): NIXL validates fresh lists against the registration on every call.
  Lists are prepared lazily on a layer's first write. Remote lists belong to
  one remote agent, i.e. one incarnation: `add_peer` with new metadata releases
  them with the old agent, so a restarted peer is never written through stale
  handles.
  Mismatched TP uses one descriptor per token row (layer-major) or per block
  (paged; see tp_slicing.slice_descriptors) through `initialize_xfer`. The
  payload-carrying completion notification is a standalone NIXL notification
  sent once all of the request's writes are DONE (a DONE WRITE is remotely
  complete: UCX flushes before reporting it).
- Progress on loopback: UCX picks `cma` (process_vm_writev) for DRAM puts,
  which is one-sided and copies inside `transfer()` on the sender's core. The
  receiver must still progress for endpoint wire-up (the first transfer from
  a new sender hangs until it does) and for notifications; that is what
  `progress()`/`wait_notification()` are for. Other transports (UCX_TLS=tcp)
  emulate puts with active messages and need the receiver on every fragment.

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

from splitserve.kvtransfer.connector import AgentMetadata, Connector, Reservation, TransferHandle
from splitserve.kvtransfer import auth
from splitserve.kvtransfer.errors import LayoutMismatchError, PeerAuthError, PeerLostError, TransferError
from splitserve.kvtransfer.tp_slicing import HeadSlice, block_rows, slice_descriptors
from splitserve.kvtransfer.frames import Notification

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
        self._agent_peers: dict[str, tuple[str, str]] = {}   # loaded NIXL agent → (peer name, incarnation)
        self._reg_descs = None
        self._mem_type = "DRAM"
        self._device_id = 0
        self._writes: dict[tuple[str, str], list[TransferHandle]] = {}
        self._local_dlists: dict[int, object] = {}               # layer → prepped local list
        self._remote_dlists: dict[str, dict[int, object]] = {}   # NIXL agent → layer → prepped list
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
        return self._sign(AgentMetadata(self.name, self.incarnation, self.backend, "", self.layout,
                                        self.layout.layout_hash(), self.num_blocks, bases, str(pool.device), blob))

    def _add_peer(self, meta: AgentMetadata) -> None:
        with self._nixl_lock:
            loaded = self._agent.add_remote_agent(meta.agent_blob)
        agent = loaded.decode() if isinstance(loaded, bytes) else loaded
        self._remote[meta.name] = agent
        self._agent_peers[agent] = (meta.name, meta.incarnation)

    def _remove_peer(self, meta: AgentMetadata) -> None:
        remote = self._remote.pop(meta.name, None)
        if remote is None:
            return
        with self._nixl_lock:
            self._release_dlists(self._remote_dlists.pop(remote, {}))
            self._agent_peers.pop(remote, None)
            try:
                self._agent.remove_remote_agent(remote)
            except Exception as error:      # a dead peer may refuse a clean disconnect
                logger.info("agent %s: removing stale peer %s: %r", self.name, remote, error)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._nixl_lock:
            for dlists in self._remote_dlists.values():
                self._release_dlists(dlists)
            self._remote_dlists.clear()
            self._release_dlists(self._local_dlists)
            self._local_dlists = {}
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

    def cached_peer_state(self) -> list[tuple[str, str]]:
        """(peer name, incarnation) of every remote agent that has prepared descriptor lists here."""
        with self._nixl_lock:
            return sorted(self._agent_peers[agent] for agent, lists in self._remote_dlists.items() if lists)

    # -- sender side -----------------------------------------------------------------------
    def _block_table(self, base: int, num_blocks: int, block_bytes: int, device_id: int) -> np.ndarray:
        """[2 * num_blocks, 3] (addr, len, device) rows of `block_bytes` from a layer's base: its whole
        region, whichever layout (tp_slicing.block_rows says which rows hold a block)."""
        index = np.arange(2 * num_blocks, dtype=np.uint64)
        table = np.empty((2 * num_blocks, 3), dtype=np.uint64)
        table[:, 0] = np.uint64(base) + index * np.uint64(block_bytes)
        table[:, 1] = block_bytes
        table[:, 2] = device_id
        return table

    def _local_dlist(self, layer: int):
        handle = self._local_dlists.get(layer)
        if handle is None:
            table = self._block_table(self._require_pool()[layer].data_ptr(), self.num_blocks,
                                      self.layout.block_bytes, self._device_id)
            handle = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", table, self._mem_type)
            self._local_dlists[layer] = handle
        return handle

    def _remote_dlist(self, peer: AgentMetadata, remote: str, layer: int):
        per_layer = self._remote_dlists.setdefault(remote, {})
        handle = per_layer.get(layer)
        if handle is None:
            table = self._block_table(peer.layer_base_addrs[layer], peer.num_blocks, peer.layout.block_bytes,
                                      _device_index(peer.device))
            handle = self._agent.prep_xfer_dlist(remote, table, "VRAM" if peer.device.startswith("cuda")
                                                 else "DRAM")
            per_layer[layer] = handle
        return handle

    def _release_dlists(self, dlists: dict[int, object]) -> None:
        for handle in dlists.values():
            try:
                self._agent.release_dlist_handle(handle)
            except Exception as error:
                logger.info("agent %s: releasing a descriptor list: %r", self.name, error)

    def _xfer_list(self, rows: np.ndarray, device_id: int, mem_type: str):
        table = np.empty((rows.shape[0], 3), dtype=np.uint64)
        table[:, :2] = rows
        table[:, 2] = device_id
        return self._agent.get_xfer_descs(table, mem_type)

    def _make_xfer(self, peer: AgentMetadata, remote: str, layer: int, src: np.ndarray, dst: np.ndarray,
                   hs: HeadSlice):
        """The transfer request for one write (NIXL lock held)."""
        if hs.whole_rows:
            local_index = block_rows(self.layout, src, self.num_blocks).astype(np.int32)
            remote_index = block_rows(peer.layout, dst, peer.num_blocks).astype(np.int32)
            return self._agent.make_prepped_xfer("WRITE", self._local_dlist(layer), local_index,
                                                 self._remote_dlist(peer, remote, layer), remote_index,
                                                 skip_desc_merge=not self.coalesce)
        src_rows = slice_descriptors(self._require_pool()[layer].data_ptr(), self.num_blocks, src, self.layout,
                                     hs.src_offset, hs.num_heads)
        dst_rows = slice_descriptors(peer.layer_base_addrs[layer], peer.num_blocks, dst, peer.layout,
                                     hs.dst_offset, hs.num_heads)
        peer_mem = "VRAM" if peer.device.startswith("cuda") else "DRAM"
        return self._agent.initialize_xfer("WRITE", self._xfer_list(src_rows, self._device_id, self._mem_type),
                                           self._xfer_list(dst_rows, _device_index(peer.device), peer_mem),
                                           remote, b"")

    def _post_write(self, peer: AgentMetadata, reservation: Reservation, layer: int, src_block_ids: np.ndarray,
                    dst_block_ids: np.ndarray, hs: HeadSlice) -> TransferHandle:
        row_bytes = hs.num_heads * self.layout.head_dim * self.layout.itemsize
        num_bytes = 2 * len(src_block_ids) * self.layout.block_size * row_bytes
        handle = self._new_handle(reservation, peer.name, "write", layer, num_bytes)
        try:
            with self._nixl_lock:
                remote = self._remote[peer.name]
                xfer = self._make_xfer(peer, remote, layer, src_block_ids, dst_block_ids, hs)
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
                     payload: bytes, progress: bool = False) -> TransferHandle:
        message = Notification(reservation.request_id, reservation.incarnation, block_ids, payload,
                               self.layout.layout_hash()).encode()
        message += auth.tag(self.token, message)        # the receiver accepts it only with the token
        handle = self._new_handle(reservation, peer.name, "progress" if progress else "notify", -1, len(payload))
        with self._lock:
            # A progress note waits for no write (its sender waited for what it reports).
            writes = [] if progress else self._writes.pop((peer.name, reservation.request_id), [])
            self._notifies.append(_PendingNotify(handle, self._remote[peer.name], message, writes))
        self._progress()
        return handle

    def _check(self, handle: TransferHandle) -> None:
        if handle.kind != "write":
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
                    raw = bytes(raw)
                    if not auth.verify(self.token, raw[-auth.TAG_BYTES:], raw[:-auth.TAG_BYTES]):
                        raise PeerAuthError("the notification does not carry this deployment's transfer token; "
                                            "its request's KV is not accepted")
                    note = Notification.decode(raw[:-auth.TAG_BYTES])
                    if note.sender_layout and note.sender_layout != self.layout.layout_hash():
                        table.refuse(note.request_id, note.incarnation, LayoutMismatchError(
                            f"request {note.request_id}: {sender} wrote it with KV layout hash "
                            f"{note.sender_layout[:12]}..., this receiver's is {self.layout.layout_hash()[:12]}...: "
                            "another model, configuration or weights revision; its KV is not used"))
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


def _device_index(device: str) -> int:
    """"cuda:1" → 1; "cpu" → 0 (NIXL's device id for DRAM)."""
    return int(device.split(":")[1]) if ":" in device else 0
