"""TCP backend: plain asyncio sockets, no extra libraries.

Each connector runs one asyncio loop in its own I/O thread: a listener that
accepts senders, a reader per outgoing connection (replies) and a server task
per incoming one. Completion is a `concurrent.futures.Future` the handle holds.

Wire: a frame header (wire.FrameHeader: request id, receiver incarnation,
layer, head range, destination block ids, payload length), then the payload:
the head range of the destination blocks in order, laid out like one layer of
those blocks (`KVLayout.layer_shape`: K rows then V rows in the layer-major
layout, one page per block in the paged one). The receiver checks
the header against its reservation table *before* reading the payload; a
refused frame's payload is drained into a scratch buffer and an error reply
names the reason, so nothing is written. One reply per frame, matched by seq.

Sending is non-blocking and starts in the caller's thread: `write_layer`
queues the frame on the peer's connection and, if nothing is queued ahead of
it, pushes as the socket buffer takes right away with `sendmsg` (the
kernel copies straight out of the pool); only the rest is left to the I/O
thread, which resumes when the socket is writable. So a layer that fits the
socket buffer is on its way when `write_layer` returns and the compute loop is
not at the mercy of the I/O thread getting the GIL and the (shared) core.

Speed: payload bytes go straight between the pools and the sockets. The
sender gathers a request's runs of consecutive blocks (numpy, no per-block
Python) into one `sendmsg` of memoryviews (writev); the receiver scatters with
`recvmsg_into` (readv) straight into the destination runs (tp_slicing.run_spans:
two spans per run layer-major, one paged). Each side coalesces its
own ids (runs need not line up across the two sides); `coalesce=False` sends and
receives one view per block (for comparison). Socket buffers are
8 MiB (as far as net.core.{w,r}mem_max allow) and a receiver waiting for a
large payload sets SO_RCVLOWAT so it wakes once per chunk, not per segment.
Mismatched TP (or a CUDA pool) goes through a contiguous staging tensor
(tp_slicing.gather_slice / scatter_slice: one index_select / index_copy).
"""

from __future__ import annotations

import array
import asyncio
import concurrent.futures
import fcntl
import logging
import os
import socket
import termios
import threading
from collections import deque

import numpy as np
import torch

from splitserve.kvtransfer.connector import AgentMetadata, Connector, Reservation, TransferHandle
from splitserve.kvtransfer import auth
from splitserve.kvtransfer.errors import (CODE_BY_ERROR, ERRORS_BY_CODE, LayoutMismatchError, PeerAuthError, PeerLostError, StalePeerError,
                     TransferError)
from splitserve.kvtransfer.tp_slicing import HeadSlice, gather_slice, run_spans, scatter_slice, side_runs
from splitserve.kvtransfer.frames import (CHALLENGE, CHALLENGE_MAGIC, FRAME_HEADER, HELLO, HELLO_MAGIC, KIND_NOTIFY, KIND_WRITE, REPLY_HEADER,
                   FrameHeader, encode_reply)

logger = logging.getLogger(__name__)

SOCKET_BUFFER = 8 << 20
RCVLOWAT_MAX = 512 << 10          # a waiting receiver wakes once this much (or the rest) has arrived
_DRAIN_CHUNK = 1 << 20
try:
    IOV_MAX = max(16, min(os.sysconf("SC_IOV_MAX"), 1024))
except (ValueError, OSError):
    IOV_MAX = 1024


class _Frame:
    """A frame being sent: the header and payload views, consumed from the front."""

    __slots__ = ("seq", "views", "index", "future")

    def __init__(self, seq: int, views: list[memoryview], future: concurrent.futures.Future):
        self.seq, self.views, self.index, self.future = seq, views, 0, future

    def advance(self, sent: int) -> None:
        views, i = self.views, self.index
        while sent:
            size = views[i].nbytes
            if sent >= size:
                sent -= size
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0
        while i < len(views) and not views[i].nbytes:
            i += 1
        self.index = i

    @property
    def sent(self) -> bool:
        return self.index >= len(self.views)


class _Outgoing:
    """One connection to one peer incarnation.

    `lock` (a thread lock) guards everything below it; frames leave in queue order and
    whole. Invariant while connected and not broken: the queue is empty, or the writer
    is armed (the I/O thread resumes on writability), or a thread holding the lock is
    flushing it.
    """

    def __init__(self, peer: AgentMetadata):
        self.peer = peer
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.queue: deque[_Frame] = deque()
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.writer_armed = False
        self.reader: asyncio.Task | None = None
        self.broken: TransferError | None = None
        self.cleaned = False


class TcpConnector(Connector):
    backend = "tcp"

    def __init__(self, name, layout, *, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 **kwargs):
        """Listen on host:port; peers dial `advertise_host` (default: `host`), which is what a
        process listening on every interface (0.0.0.0 in a pod) must give: its reachable address."""
        super().__init__(name, layout, **kwargs)
        self._listener = socket.create_server((host, port), backlog=64)
        self._listener.setblocking(False)
        bound_host, bound_port = self._listener.getsockname()[:2]
        self.address = f"{advertise_host or bound_host}:{bound_port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"kvtransfer-tcp-{name}", daemon=True)
        self._outgoing: dict[str, _Outgoing] = {}
        self._seq = 0
        self._pool_bytes: np.ndarray | None = None
        self._pool_view: memoryview | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._thread.start()

    # -- setup -----------------------------------------------------------------------------
    def _register(self, pool: torch.Tensor) -> None:
        if pool.device.type == "cpu":
            self._pool_bytes = pool.view(torch.uint8).reshape(-1).numpy()
            self._pool_view = memoryview(self._pool_bytes)
        asyncio.run_coroutine_threadsafe(self._start_accepting(), self._loop).result()

    def metadata(self) -> AgentMetadata:
        pool = self._require_pool()
        bases = tuple(pool[layer].data_ptr() for layer in range(self.layout.num_layers))
        return self._sign(AgentMetadata(self.name, self.incarnation, self.backend, self.address, self.layout,
                                        self.layout.layout_hash(), self.num_blocks, bases, str(pool.device)))

    def _add_peer(self, meta: AgentMetadata) -> None:
        pass                       # connect lazily on the first frame

    def _remove_peer(self, meta: AgentMetadata) -> None:
        with self._lock:
            conn = self._outgoing.pop(meta.name, None)
        if conn is not None:
            error = StalePeerError(f"peer {meta.name} was replaced by a new incarnation")
            self._loop.call_soon_threadsafe(self._break, conn, error)

    def cached_peer_state(self) -> list[tuple[str, str]]:
        """(peer name, incarnation) of every open (or opening) outgoing connection."""
        with self._lock:
            return sorted((conn.peer.name, conn.peer.incarnation) for conn in self._outgoing.values()
                          if conn.broken is None)

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
    def _post_write(self, peer: AgentMetadata, reservation: Reservation, layer: int, src_block_ids: np.ndarray,
                    dst_block_ids: np.ndarray, hs: HeadSlice) -> TransferHandle:
        parts = self._payload(layer, src_block_ids, hs)
        num_bytes = sum(p.nbytes for p in parts)
        header = self._header(KIND_WRITE, reservation, layer, hs, dst_block_ids, num_bytes)
        return self._submit(peer, reservation, "write", layer, header, parts, num_bytes)

    def _post_notify(self, peer: AgentMetadata, reservation: Reservation, block_ids: tuple[int, ...],
                     payload: bytes, progress: bool = False) -> TransferHandle:
        header = self._header(KIND_NOTIFY, reservation, 0, None, block_ids, len(payload))
        kind = "progress" if progress else "notify"     # frames go in order: behind the writes posted before
        return self._submit(peer, reservation, kind, -1, header, [memoryview(payload)], len(payload))

    def _payload(self, layer: int, src_block_ids: np.ndarray, hs: HeadSlice) -> list[memoryview]:
        pool = self._require_pool()
        if hs.whole_rows and self._pool_view is not None:
            return self._run_views(layer, src_block_ids)
        staged = gather_slice(pool, layer, src_block_ids, hs, self.layout.paged).cpu()
        return [memoryview(staged.view(torch.uint8).reshape(-1).numpy())]

    def _run_views(self, layer: int, block_ids: np.ndarray) -> list[memoryview]:
        """Views of the pool over `block_ids`' bytes in wire order, per run of consecutive ids
        (per block when coalescing is off): K then V runs (layer-major) or one per run (paged)."""
        lay, view = self.layout, self._pool_view
        starts, counts = side_runs(block_ids, self.coalesce)
        offsets, lengths = run_spans(lay, starts, counts, layer * lay.layer_bytes(self.num_blocks), self.num_blocks)
        return [view[a:a + n] for a, n in zip(offsets.tolist(), lengths.tolist())]

    def _header(self, kind: int, reservation: Reservation, layer: int, hs: HeadSlice | None,
                block_ids, num_bytes: int) -> FrameHeader:
        with self._lock:
            self._seq += 1
            seq = self._seq
        lo, hi = (hs.lo, hs.hi) if hs is not None else (0, 0)
        return FrameHeader(kind, seq, reservation.request_id, reservation.incarnation, layer, lo, hi, block_ids,
                           num_bytes)

    def _submit(self, peer, reservation, kind, layer, header, parts, num_bytes) -> TransferHandle:
        future: concurrent.futures.Future = concurrent.futures.Future()
        handle = self._new_handle(reservation, peer.name, kind, layer, num_bytes, future)
        frame = _Frame(header.seq, [memoryview(header.encode()), *parts], future)
        conn = self._connection(peer)
        with conn.lock:
            if conn.broken is not None:
                _fail(future, conn.broken)
                return handle
            conn.pending[frame.seq] = future
            conn.queue.append(frame)
            if conn.sock is None or conn.writer_armed:
                return handle              # connecting, or the I/O thread is draining the queue
            self._flush_locked(conn)
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

    # -- sending (caller threads and the I/O thread) -----------------------------------------
    def _connection(self, peer: AgentMetadata) -> _Outgoing:
        with self._lock:
            conn = self._outgoing.get(peer.name)
            if conn is None or conn.peer.incarnation != peer.incarnation or conn.broken is not None:
                conn = _Outgoing(peer)
                self._outgoing[peer.name] = conn
                self._loop.call_soon_threadsafe(self._spawn, self._connect(conn))
        return conn

    def _flush_locked(self, conn: _Outgoing) -> None:
        """Send queued frames without blocking (conn.lock held); arm the writer if the socket is full."""
        sock = conn.sock
        try:
            while conn.queue:
                frame = conn.queue[0]
                while not frame.sent:
                    batch = frame.views[frame.index:_batch_end(frame.views, frame.index, SOCKET_BUFFER)]
                    try:
                        sent = sock.sendmsg(batch) if len(batch) > 1 else sock.send(batch[0])
                    except (BlockingIOError, InterruptedError):
                        if not conn.writer_armed:
                            conn.writer_armed = True
                            self._loop.call_soon_threadsafe(self._arm_writer, conn)
                        return
                    frame.advance(sent)
                conn.queue.popleft()
        except OSError as error:
            self._fail_locked(conn, PeerLostError(f"sending to {conn.peer.name} failed: {error!r}"))
            self._loop.call_soon_threadsafe(self._break, conn, conn.broken)
            return
        if conn.writer_armed:
            conn.writer_armed = False
            self._loop.call_soon_threadsafe(self._disarm_writer, conn)

    def _arm_writer(self, conn: _Outgoing) -> None:
        with conn.lock:
            if conn.broken is None and conn.writer_armed and conn.sock is not None:
                self._loop.add_writer(conn.sock, self._on_writable, conn)

    def _disarm_writer(self, conn: _Outgoing) -> None:
        with conn.lock:
            if not conn.writer_armed and conn.sock is not None and not conn.cleaned:
                self._loop.remove_writer(conn.sock)

    def _on_writable(self, conn: _Outgoing) -> None:
        with conn.lock:
            if conn.broken is None and conn.sock is not None:
                self._flush_locked(conn)   # stays armed while the socket is full; disarms once drained

    def _fail_locked(self, conn: _Outgoing, error: TransferError) -> None:
        """Mark the connection broken and fail every frame on it (conn.lock held)."""
        if conn.broken is None:
            conn.broken = error
        futures = list(conn.pending.values()) + [frame.future for frame in conn.queue]
        conn.pending.clear()
        conn.queue.clear()
        for future in futures:
            _fail(future, conn.broken)

    def _break(self, conn: _Outgoing, error: TransferError) -> None:
        """I/O thread: fail the connection's frames and close its socket (once)."""
        with conn.lock:
            self._fail_locked(conn, error)
            sock, reader = conn.sock, conn.reader
            cleanup = not conn.cleaned
            conn.cleaned = True
            if sock is not None and cleanup:
                self._loop.remove_writer(sock)
                conn.writer_armed = False
        with self._lock:
            if self._outgoing.get(conn.peer.name) is conn:
                del self._outgoing[conn.peer.name]
        if sock is None or not cleanup:
            return
        if reader is not None and not reader.done() and reader is not asyncio.current_task():
            # Close only once the reader's pending sock_recv has unregistered the descriptor.
            reader.add_done_callback(lambda _: sock.close())
            reader.cancel()
        else:
            sock.close()

    # -- I/O loop: connecting and replies ------------------------------------------------------
    def _spawn(self, coro) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect(self, conn: _Outgoing) -> None:
        peer = conn.peer
        host, port = peer.address.rsplit(":", 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _tune(sock)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(self._loop.sock_connect(sock, (host, int(port))), self.timeout_s)
            await asyncio.wait_for(self._answer_challenge(sock, peer), self.timeout_s)
        except TransferError as error:
            sock.close()
            self._break(conn, error)
            return
        except (OSError, EOFError, ValueError, asyncio.TimeoutError) as error:
            sock.close()
            self._break(conn, PeerLostError(f"cannot connect to {peer.name} at {peer.address}: {error!r}"))
            return
        except asyncio.CancelledError:
            sock.close()
            self._break(conn, PeerLostError(f"connection to {peer.name} closed"))
            raise
        with conn.lock:
            if conn.broken is not None:
                sock.close()
                return
            conn.sock = sock
            conn.reader = self._loop.create_task(self._read_replies(conn))
            self._flush_locked(conn)

    async def _answer_challenge(self, sock: socket.socket, peer: AgentMetadata) -> None:
        """Prove the transfer token to a receiver (auth.py); raises its refusal as a TransferError."""
        magic, nonce = CHALLENGE.unpack(await _recv_exact(sock, CHALLENGE.size))
        if magic != CHALLENGE_MAGIC:
            raise ValueError(f"{peer.name} at {peer.address} is not a splitserve KV receiver")
        layout_hash = self.layout.layout_hash()
        proof = auth.tag(self.token, nonce, peer.incarnation, layout_hash)
        await self._loop.sock_sendall(sock, HELLO.pack(HELLO_MAGIC, layout_hash.encode(), proof))
        _, _, code, msg_len = REPLY_HEADER.unpack(await _recv_exact(sock, REPLY_HEADER.size))
        message = (await _recv_exact(sock, msg_len)).decode() if msg_len else ""
        if code:
            raise ERRORS_BY_CODE.get(code, TransferError)(f"{peer.name} refused the connection: {message}")

    async def _read_replies(self, conn: _Outgoing) -> None:
        try:
            while True:
                magic, seq, code, msg_len = REPLY_HEADER.unpack(await _recv_exact(conn.sock, REPLY_HEADER.size))
                message = (await _recv_exact(conn.sock, msg_len)).decode() if msg_len else ""
                with conn.lock:
                    future = conn.pending.pop(seq, None)
                if future is None or future.done():
                    continue
                try:
                    if code == 0:
                        future.set_result(None)
                    else:
                        future.set_exception(ERRORS_BY_CODE.get(code, TransferError)(message))
                except concurrent.futures.InvalidStateError:
                    pass                      # abandoned (cancelled) by its owner meanwhile
        except (OSError, EOFError) as error:
            self._break(conn, PeerLostError(f"connection to {conn.peer.name} lost: {error!r}"))
        except asyncio.CancelledError:
            self._break(conn, PeerLostError(f"connection to {conn.peer.name} closed"))

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
            if not await asyncio.wait_for(self._challenge(sock), self.timeout_s):
                return
            while True:
                try:
                    fixed = await _recv_exact(sock, FRAME_HEADER.size)
                except EOFError:
                    return                                # clean close between frames
                header = FrameHeader.decode(fixed, await _recv_exact(sock, FrameHeader.variable_len(fixed)))
                code, message = await self._handle_frame(sock, header, table)
                await loop.sock_sendall(sock, encode_reply(header.seq, code, message))
        except (OSError, EOFError, ValueError) as error:
            failed = table.fail_from_source(sock, lambda rid, error=error: PeerLostError(
                f"request {rid}: the sender's connection broke mid-transfer ({error!r}); reservation released"))
            if failed:
                logger.warning("agent %s: sender lost, failed requests %s", self.name, failed)
        finally:
            table.fail_from_source(sock, lambda rid: PeerLostError(
                f"request {rid}: the sender disconnected before notifying; reservation released"))
            sock.close()

    async def _challenge(self, sock: socket.socket) -> bool:
        """Open an accepted connection: the sender must prove the token and its layout hash (auth.py)."""
        loop = asyncio.get_running_loop()
        nonce = auth.new_nonce()
        await loop.sock_sendall(sock, CHALLENGE.pack(CHALLENGE_MAGIC, nonce))
        magic, layout_hash, proof = HELLO.unpack(await _recv_exact(sock, HELLO.size))
        mine = self.layout.layout_hash()
        error: TransferError | None = None
        if magic != HELLO_MAGIC or not auth.verify(self.token, proof, nonce, self.incarnation,
                                                   layout_hash.decode("ascii", "replace")):
            error = PeerAuthError("the sender did not present this deployment's transfer token "
                                  "(--transfer-token / SPLITSERVE_TRANSFER_TOKEN)")
        elif layout_hash.decode("ascii", "replace") != mine:
            error = LayoutMismatchError(f"the sender's KV layout hash {layout_hash[:12]!r}... differs from "
                                        f"{mine[:12]}...: it serves a different model or configuration")
        if error is None:
            await loop.sock_sendall(sock, encode_reply(0, 0))
            return True
        self._count_failure(type(error))
        logger.warning("agent %s: refused a KV sender connection: %s", self.name, error)
        await loop.sock_sendall(sock, encode_reply(0, CODE_BY_ERROR[type(error)], str(error)))
        return False

    async def _handle_frame(self, sock, header: FrameHeader, table) -> tuple[int, str]:
        try:
            if header.kind == KIND_NOTIFY:
                payload = bytes(await _recv_exact(sock, header.payload_len))
                progress = table.complete(header.request_id, header.incarnation, header.block_ids, payload)
                self.metrics.transfers.labels(self.backend, "recv", "progress" if progress else "notify").inc()
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
        dst = np.asarray(header.block_ids, dtype=np.int64)
        whole = (header.head_lo, header.head_hi) == (lay.head_start, lay.head_end)
        if whole and self._pool_view is not None:
            await _recv_views(sock, self._run_views(header.layer, dst))   # readv straight into the runs
            return
        num_heads = header.head_hi - header.head_lo
        staged = torch.empty(lay.layer_shape(len(dst), num_heads), dtype=lay.torch_dtype)
        await _recv_views(sock, [memoryview(staged.view(torch.uint8).reshape(-1).numpy())])
        hs = HeadSlice(header.head_lo, header.head_hi, 0, header.head_lo - lay.head_start, False)
        scatter_slice(pool, header.layer, dst, hs, staged, lay.paged)

    async def _shutdown(self) -> None:
        with self._lock:
            conns = list(self._outgoing.values())
        for conn in conns:
            self._break(conn, PeerLostError("connector closed"))
        for task in list(self._tasks):
            task.cancel()


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


def _fail(future: concurrent.futures.Future, error: TransferError) -> None:
    if not future.done():
        try:
            future.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass


async def _readable(sock: socket.socket, want: int) -> None:
    """Wait until `want` bytes (capped at RCVLOWAT_MAX), EOF or an error can be read."""
    loop = asyncio.get_running_loop()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, max(1, min(want, RCVLOWAT_MAX)))
    waiter = loop.create_future()
    loop.add_reader(sock, _wake, waiter)
    try:
        await waiter
    finally:
        loop.remove_reader(sock)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _readable_bytes(sock: socket.socket) -> int:
    """Bytes the socket holds ready to read (FIONREAD)."""
    count = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, count)
    return count[0]


def _batch_end(views: list[memoryview], i: int, nbytes: int) -> int:
    """End of the shortest batch of views from `i` that holds `nbytes` (at least one view, at most IOV_MAX)."""
    end, limit = i + 1, min(len(views), i + IOV_MAX)
    nbytes -= views[i].nbytes
    while nbytes > 0 and end < limit:
        nbytes -= views[end].nbytes
        end += 1
    return end


async def _recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill `views` in order from the socket (readv of up to IOV_MAX views per call).

    Each readv gets only the views that what is ready fills: recvmsg_into takes a buffer of
    every view it is given, which for 1024 views of 16 KiB cost as much as copying 512 KiB.
    """
    views = [v for v in views if v.nbytes]
    remaining = sum(v.nbytes for v in views)
    i = 0
    while remaining:
        end = _batch_end(views, i, _readable_bytes(sock))
        try:
            n = sock.recvmsg_into(views[i:end])[0] if end - i > 1 else sock.recv_into(views[i])
        except (BlockingIOError, InterruptedError):
            await _readable(sock, remaining)
            continue
        if n == 0:
            raise EOFError(f"peer closed the connection with {remaining} bytes still expected")
        remaining -= n
        while n:
            size = views[i].nbytes
            if n >= size:
                n -= size
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0


async def _recv_into(sock: socket.socket, view: memoryview) -> None:
    await _recv_views(sock, [view])


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
