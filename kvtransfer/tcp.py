"""TCP backend: plain asyncio sockets, no extra libraries.

Each connector runs one asyncio loop in its own I/O thread: a listener that
accepts senders, and one outgoing connection per peer incarnation. Public
methods are called from the owner's thread and hand work to the loop with
`run_coroutine_threadsafe`; completion is a `concurrent.futures.Future` the
handle holds.

Wire: a frame header (wire.FrameHeader: request id, receiver incarnation,
layer, head range, destination block ids, payload length), then the payload,
K rows then V rows, for the destination blocks in order. The receiver checks
the header against its reservation table *before* reading the payload; a
refused frame's payload is drained into a scratch buffer and an error reply
names the reason, so nothing is written. One reply per frame, matched by seq.

Speed: payload bytes go straight between the pools and the sockets —
`sock_sendall` of memoryviews over contiguous block runs, `sock_recv_into`
memoryviews of the destination runs — with 8 MiB socket buffers; there is no
per-block Python work when both sides hold the same heads. Mismatched TP (or a
CUDA pool) goes through a contiguous staging tensor (tp_slicing.gather_slice /
scatter_slice).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading

import numpy as np
import torch

from .connector import AgentMetadata, Connector, Reservation, TransferHandle
from .errors import CODE_BY_ERROR, ERRORS_BY_CODE, PeerLostError, StalePeerError, TransferError
from .tp_slicing import HeadSlice, block_runs, gather_slice, scatter_slice
from .wire import FRAME_HEADER, KIND_NOTIFY, KIND_WRITE, REPLY_HEADER, FrameHeader, encode_reply

logger = logging.getLogger(__name__)

SOCKET_BUFFER = 8 << 20
_DRAIN_CHUNK = 1 << 20


class _Outgoing:
    """One connection to one peer incarnation; frames are sent whole under `lock`."""

    def __init__(self, peer: AgentMetadata):
        self.peer = peer
        self.sock: socket.socket | None = None
        self.lock = asyncio.Lock()
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.reader: asyncio.Task | None = None
        self.broken: TransferError | None = None


class TcpConnector(Connector):
    backend = "tcp"

    def __init__(self, name, layout, *, host: str = "127.0.0.1", port: int = 0, **kwargs):
        super().__init__(name, layout, **kwargs)
        self._listener = socket.create_server((host, port), backlog=64)
        self._listener.setblocking(False)
        self.address = "%s:%d" % self._listener.getsockname()[:2]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"kvtransfer-tcp-{name}", daemon=True)
        self._outgoing: dict[str, _Outgoing] = {}
        self._seq = 0
        self._pool_bytes: np.ndarray | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._thread.start()

    # -- setup -----------------------------------------------------------------------------
    def _register(self, pool: torch.Tensor) -> None:
        if pool.device.type == "cpu":
            self._pool_bytes = pool.view(torch.uint8).reshape(-1).numpy()
        asyncio.run_coroutine_threadsafe(self._start_accepting(), self._loop).result()

    def metadata(self) -> AgentMetadata:
        pool = self._require_pool()
        bases = tuple(pool[layer].data_ptr() for layer in range(self.layout.num_layers))
        return AgentMetadata(self.name, self.incarnation, self.backend, self.address, self.layout,
                             self.layout.layout_hash(), self.num_blocks, bases, str(pool.device))

    def _add_peer(self, meta: AgentMetadata) -> None:
        pass                       # connect lazily on the first frame

    def _remove_peer(self, meta: AgentMetadata) -> None:
        conn = self._outgoing.pop(meta.name, None)
        if conn is not None:
            error = StalePeerError(f"peer {meta.name} was replaced by a new incarnation")
            self._loop.call_soon_threadsafe(self._break, conn, error)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=5)
        except (concurrent.futures.TimeoutError, RuntimeError):
            logger.warning("agent %s: TCP I/O loop did not shut down cleanly", self.name)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._listener.close()

    # -- sender side -----------------------------------------------------------------------
    def _post_write(self, peer: AgentMetadata, reservation: Reservation, layer: int, src_block_ids: list[int],
                    dst_block_ids: list[int], hs: HeadSlice) -> TransferHandle:
        parts = self._payload(layer, src_block_ids, hs)
        num_bytes = sum(p.nbytes for p in parts)
        header = self._header(KIND_WRITE, reservation, layer, hs, tuple(dst_block_ids), num_bytes)
        return self._submit(peer, reservation, "write", layer, header, parts, num_bytes)

    def _post_notify(self, peer: AgentMetadata, reservation: Reservation, block_ids: tuple[int, ...],
                     payload: bytes) -> TransferHandle:
        header = self._header(KIND_NOTIFY, reservation, 0, None, block_ids, len(payload))
        return self._submit(peer, reservation, "notify", -1, header, [memoryview(payload)], len(payload))

    def _payload(self, layer: int, src_block_ids: list[int], hs: HeadSlice) -> list[memoryview]:
        pool = self._require_pool()
        if hs.whole_rows and self._pool_bytes is not None:
            bb = self.layout.block_bytes
            parts = []
            for kv in range(2):
                region = (layer * 2 + kv) * self.num_blocks
                for start, count in block_runs(src_block_ids):
                    parts.append(memoryview(self._pool_bytes[(region + start) * bb:(region + start + count) * bb]))
            return parts
        staged = gather_slice(pool, layer, src_block_ids, hs).cpu()
        return [memoryview(staged.view(torch.uint8).reshape(-1).numpy())]

    def _header(self, kind: int, reservation: Reservation, layer: int, hs: HeadSlice | None,
                block_ids: tuple[int, ...], num_bytes: int) -> FrameHeader:
        with self._lock:
            self._seq += 1
            seq = self._seq
        lo, hi = (hs.lo, hs.hi) if hs is not None else (0, 0)
        return FrameHeader(kind, seq, reservation.request_id, reservation.incarnation, layer, lo, hi, block_ids,
                           num_bytes)

    def _submit(self, peer, reservation, kind, layer, header, parts, num_bytes) -> TransferHandle:
        future: concurrent.futures.Future = concurrent.futures.Future()
        handle = self._new_handle(reservation, peer.name, kind, layer, num_bytes, future)
        self._loop.call_soon_threadsafe(self._spawn, self._send(peer, header, parts, future))
        return handle

    def _check(self, handle: TransferHandle) -> None:
        future: concurrent.futures.Future = handle.backend_state
        if future.done():
            error = future.exception()
            if error is None:
                handle.done = True
            else:
                handle.error = error if isinstance(error, TransferError) else PeerLostError(str(error))

    def _wait_once(self, handle: TransferHandle, max_s: float) -> None:
        concurrent.futures.wait([handle.backend_state], timeout=max_s)

    def _abandon(self, handle: TransferHandle) -> None:
        handle.backend_state.cancel()

    # -- I/O loop: sending -----------------------------------------------------------------
    def _spawn(self, coro) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, peer: AgentMetadata, header: FrameHeader, parts: list[memoryview],
                    future: concurrent.futures.Future) -> None:
        loop = asyncio.get_running_loop()
        try:
            conn = await self._connection(peer)
            async with conn.lock:
                if conn.broken is not None:
                    raise conn.broken
                conn.pending[header.seq] = future
                await loop.sock_sendall(conn.sock, header.encode())
                for part in parts:
                    await loop.sock_sendall(conn.sock, part)
        except TransferError as error:
            _fail(future, error)
        except OSError as error:
            _fail(future, PeerLostError(f"request {header.request_id}: sending to {peer.name} failed: {error}"))

    async def _connection(self, peer: AgentMetadata) -> _Outgoing:
        conn = self._outgoing.get(peer.name)
        if conn is None or conn.peer.incarnation != peer.incarnation:
            conn = _Outgoing(peer)
            self._outgoing[peer.name] = conn
        async with conn.lock:
            if conn.sock is None and conn.broken is None:
                host, port = peer.address.rsplit(":", 1)
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                _tune(sock)
                sock.setblocking(False)
                try:
                    await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (host, int(port))),
                                           self.timeout_s)
                except (OSError, asyncio.TimeoutError) as error:
                    sock.close()
                    raise PeerLostError(f"cannot connect to {peer.name} at {peer.address}: {error!r}") from None
                conn.sock = sock
                conn.reader = self._loop.create_task(self._read_replies(conn))
        return conn

    async def _read_replies(self, conn: _Outgoing) -> None:
        try:
            while True:
                magic, seq, code, msg_len = REPLY_HEADER.unpack(await _recv_exact(conn.sock, REPLY_HEADER.size))
                message = (await _recv_exact(conn.sock, msg_len)).decode() if msg_len else ""
                future = conn.pending.pop(seq, None)
                if future is None or future.done():
                    continue
                if code == 0:
                    future.set_result(None)
                else:
                    future.set_exception(ERRORS_BY_CODE.get(code, TransferError)(message))
        except (OSError, EOFError) as error:
            self._break(conn, PeerLostError(f"connection to {conn.peer.name} lost: {error!r}"))
        except asyncio.CancelledError:
            self._break(conn, PeerLostError(f"connection to {conn.peer.name} closed"))

    def _break(self, conn: _Outgoing, error: TransferError) -> None:
        if conn.broken is None:
            conn.broken = error
        for future in conn.pending.values():
            _fail(future, error)
        conn.pending.clear()
        if conn.sock is not None:
            conn.sock.close()
        if self._outgoing.get(conn.peer.name) is conn:
            del self._outgoing[conn.peer.name]

    # -- I/O loop: receiving ---------------------------------------------------------------
    async def _start_accepting(self) -> None:
        self._spawn(self._accept())

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            _tune(sock)
            sock.setblocking(False)
            self._spawn(self._serve(sock))

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        table = self._require_table()
        try:
            while True:
                try:
                    fixed = await _recv_exact(sock, FRAME_HEADER.size)
                except EOFError:
                    return                                # clean close between frames
                header = FrameHeader.decode(fixed, await _recv_exact(sock, FrameHeader.variable_len(fixed)))
                code, message = await self._handle_frame(sock, header, table)
                await loop.sock_sendall(sock, encode_reply(header.seq, code, message))
        except (OSError, EOFError, ValueError) as error:
            failed = table.fail_from_source(sock, lambda rid: PeerLostError(
                f"request {rid}: the sender's connection broke mid-transfer ({error!r}); reservation released"))
            if failed:
                logger.warning("agent %s: sender lost, failed requests %s", self.name, failed)
        finally:
            table.fail_from_source(sock, lambda rid: PeerLostError(
                f"request {rid}: the sender disconnected before notifying; reservation released"))
            sock.close()

    async def _handle_frame(self, sock, header: FrameHeader, table) -> tuple[int, str]:
        try:
            if header.kind == KIND_NOTIFY:
                payload = bytes(await _recv_exact(sock, header.payload_len))
                table.complete(header.request_id, header.incarnation, header.block_ids, payload)
                self.metrics.transfers.labels(self.backend, "recv", "notify").inc()
                return 0, ""
            self._check_frame(header)
            table.begin_write(header.request_id, header.incarnation, header.block_ids, sock)
        except TransferError as error:
            if header.kind == KIND_WRITE:
                await _drain(sock, header.payload_len)
            self._count_failure(type(error))
            return CODE_BY_ERROR.get(type(error), 1), str(error)
        try:
            await self._receive_payload(sock, header)
        finally:
            table.end_write(header.request_id)
        self.metrics.transfers.labels(self.backend, "recv", "write").inc()
        self.metrics.bytes.labels(self.backend, "recv").inc(header.payload_len)
        return 0, ""

    def _check_frame(self, header: FrameHeader) -> None:
        lay = self.layout
        if not (0 <= header.layer < lay.num_layers and lay.head_start <= header.head_lo < header.head_hi <= lay.head_end):
            raise TransferError(f"request {header.request_id}: layer {header.layer} / heads "
                                f"[{header.head_lo}, {header.head_hi}) do not fit this receiver")
        expected = 2 * len(header.block_ids) * lay.block_size * (header.head_hi - header.head_lo) \
            * lay.head_dim * lay.itemsize
        if header.payload_len != expected:
            raise TransferError(f"request {header.request_id}: payload of {header.payload_len} bytes, "
                                f"expected {expected}")

    async def _receive_payload(self, sock, header: FrameHeader) -> None:
        lay, pool = self.layout, self._require_pool()
        dst = list(header.block_ids)
        whole = (header.head_lo, header.head_hi) == (lay.head_start, lay.head_end)
        if whole and self._pool_bytes is not None:
            bb = lay.block_bytes
            for kv in range(2):
                region = (header.layer * 2 + kv) * self.num_blocks
                for start, count in block_runs(dst):
                    view = memoryview(self._pool_bytes[(region + start) * bb:(region + start + count) * bb])
                    await _recv_into(sock, view)
            return
        num_heads = header.head_hi - header.head_lo
        staged = torch.empty(2, len(dst), lay.block_size, num_heads, lay.head_dim, dtype=lay.torch_dtype)
        await _recv_into(sock, memoryview(staged.view(torch.uint8).reshape(-1).numpy()))
        hs = HeadSlice(header.head_lo, header.head_hi, 0, header.head_lo - lay.head_start, False)
        scatter_slice(pool, header.layer, dst, hs, staged)

    async def _shutdown(self) -> None:
        for conn in list(self._outgoing.values()):
            if conn.reader is not None:
                conn.reader.cancel()
            self._break(conn, PeerLostError("connector closed"))
        for task in list(self._tasks):
            task.cancel()


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


def _fail(future: concurrent.futures.Future, error: TransferError) -> None:
    if not future.done():
        future.set_exception(error)


async def _recv_into(sock: socket.socket, view: memoryview) -> None:
    loop = asyncio.get_running_loop()
    got, total = 0, view.nbytes
    while got < total:
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise EOFError(f"peer closed the connection after {got} of {total} bytes")
        got += n


async def _recv_exact(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    if size:
        await _recv_into(sock, memoryview(buffer))
    return bytes(buffer)


async def _drain(sock: socket.socket, size: int) -> None:
    scratch = memoryview(bytearray(min(size, _DRAIN_CHUNK) or 1))
    while size > 0:
        chunk = min(size, len(scratch))
        await _recv_into(sock, scratch[:chunk])
        size -= chunk
