"""KVSender and KVReceiver over kvtransfer's Connector (TCP or NIXL).

One connector per worker registers the engine's KV tensor
(`[layers][2][blocks][block_size][kv_heads][head_dim]`) right after the model
is loaded, before anyone can ask for its metadata.

Prefill side (`ConnectorSender`). The decode worker's Prefill call carries its
agent metadata and grant; `begin` handshakes (`add_peer`, a no-op for a known
incarnation, a replacement for a restarted peer). `on_layer_ready` runs on the
engine thread after each layer of each chunk and posts one WRITE per layer of
the blocks that became complete — each prompt block once per layer (a block
split across chunks is sent with the chunk that completes it, so two writes
never race on one block), and never the blocks the decode worker already
holds. `finish` waits for the writes, then posts the notification carrying the
first token and waits for it.

Decode side (`ConnectorReceiver`). `expect` reserves the blocks that will be
written; `wait_complete` resolves with the notification's payload.

Both sides are driven by one `_Driver` thread per worker: while anything is
pending it polls write handles, notification handles and expected
notifications every half millisecond (NIXL runs without a progress thread, so
someone must poll; for TCP the polling only reads futures). Idle, it sleeps on
an event. No asyncio caller or engine step ever blocks on the network.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import threading
from dataclasses import dataclass, field

from splitserve.kvtransfer import AgentMetadata, Connector, KVLayout, Reservation, TransferHandle, make_connector
from splitserve.kvtransfer.errors import TransferError
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.engine.sequence import LayerReady

from .transfer import TransferEndpoint, TransferGrant, TransferTarget

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 5e-4
BACKENDS = ("nixl", "tcp")


def resolve_backend(name: str) -> str:
    """`auto` → nixl when its wheel is importable, else tcp."""
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(f"unknown KV transfer backend {name!r}; expected auto, nixl or tcp")
        return name
    for module in ("nixl_cu13", "nixl_cu12", "nixl"):
        if importlib.util.find_spec(module) is not None:
            return "nixl"
    return "tcp"


def engine_layout(engine: LLMEngine) -> KVLayout:
    mc, cfg = engine.model_config, engine.config
    model = f"{cfg.model_name}|{cfg.extra_cache_key}"
    return KVLayout(model=model, dtype=str(cfg.torch_dtype()).removeprefix("torch."),
                    num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                    block_size=cfg.block_size)


def build_connector(backend: str, name: str, engine: LLMEngine, host: str) -> Connector:
    """A connector with the engine's KV tensor registered (TCP listens on `host`)."""
    if engine.config.tensor_parallel_size != 1:
        raise TransferError("disaggregated roles need --tp 1 for now: the KV transfer registers only "
                            "rank 0's KV pool")
    kwargs = {"host": host} if backend == "tcp" else {}
    connector = make_connector(backend, name, engine_layout(engine), **kwargs)
    connector.register(engine.runner.kv.tensor)
    return connector


@dataclass(slots=True)
class _Send:
    """One request being pushed to a decode worker."""

    grant: Reservation
    dst_block_ids: list[int]         # destination of each prompt block
    num_skipped_blocks: int          # leading blocks the receiver holds already
    num_prompt_tokens: int
    next_block: list[int]            # per layer: first prompt block not yet posted
    writes: list[TransferHandle] = field(default_factory=list)
    error: TransferError | None = None
    payload: bytes | None = None     # set by finish: notify once the writes are done
    notify: TransferHandle | None = None
    waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None


class _Driver(threading.Thread):
    """Polls the connector while transfers are pending; resolves asyncio futures."""

    def __init__(self, connector: Connector):
        super().__init__(name=f"kv-transfer-{connector.name}", daemon=True)
        self.connector = connector
        self.lock = threading.Lock()
        self.sends: dict[str, _Send] = {}
        self.expected: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future] | None] = {}
        self._wake = threading.Event()
        self._stopping = False

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self.join(5)

    def run(self) -> None:
        while not self._stopping:
            with self.lock:
                busy = bool(self.expected) or bool(self.sends)
            if not busy:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                self._poll_once()
            except Exception:          # never let the driver die: requests would hang to their deadline
                log.exception("KV transfer driver: poll failed")
            self._wake.wait(POLL_INTERVAL_S)
            self._wake.clear()

    def _poll_once(self) -> None:
        self.connector.progress()
        with self.lock:
            sends = [(rid, s) for rid, s in self.sends.items() if s.waiter is not None]
            expected = [(rid, w) for rid, w in self.expected.items() if w is not None]
        for rid, send in sends:
            self._drive_send(rid, send)
        for rid, waiter in expected:
            try:
                payload = self.connector.poll_notification(rid)
            except TransferError as error:
                self._resolve_expected(rid, waiter, error=error)
                continue
            if payload is not None:
                self._resolve_expected(rid, waiter, payload=payload)

    def _drive_send(self, rid: str, send: _Send) -> None:
        c = self.connector
        try:
            if send.error is not None:
                if send.waiter is None:
                    return                      # reported by finish
                raise send.error
            if send.notify is None:
                for handle in list(send.writes):
                    if not handle.done:
                        c.poll(handle)          # raises the write's error
                if send.waiter is None or not all(h.done for h in send.writes):
                    return                      # more layers to come, or writes in flight
                send.notify = c.notify(send.grant, send.payload or b"")
            if not c.poll(send.notify):
                return
        except TransferError as error:
            if send.waiter is None:
                send.error = send.error or error
                return
            self._resolve_send(rid, send, error)
            return
        self._resolve_send(rid, send, None)

    def _resolve_send(self, rid: str, send: _Send, error: TransferError | None) -> None:
        with self.lock:
            waiter, send.waiter = send.waiter, None
            self.sends.pop(rid, None)
        if waiter is not None:
            _settle(waiter, None, error)

    def _resolve_expected(self, rid: str, waiter, payload: bytes | None = None,
                          error: TransferError | None = None) -> None:
        with self.lock:
            if self.expected.get(rid) is not waiter:
                return
            del self.expected[rid]
        _settle(waiter, payload, error)


def _settle(waiter, result, error) -> None:
    loop, future = waiter

    def apply() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    try:
        loop.call_soon_threadsafe(apply)
    except RuntimeError:       # the event loop is closed: nobody waits any more
        pass


class ConnectorTransfer:
    """Both halves over one connector; a worker uses the half its role needs."""

    def __init__(self, connector: Connector, block_size: int):
        self.connector = connector
        self.backend = connector.backend
        self.block_size = block_size
        self._meta = connector.metadata()
        self._meta_bytes = self._meta.to_bytes()
        self._driver = _Driver(connector)
        self._driver.start()

    # -- receiver (decode) ------------------------------------------------------------
    def endpoint(self) -> TransferEndpoint:
        m = self._meta
        return TransferEndpoint(m.name, self._meta_bytes, m.layout_hash.encode(), m.incarnation)

    def expect(self, request_id: str, block_ids: list[int], ttl_s: float) -> TransferGrant:
        try:
            grant = self.connector.reserve(request_id, block_ids, ttl_s)
        except ValueError as error:
            raise TransferError(f"request {request_id}: cannot reserve its blocks for a transfer: {error}") from None
        with self._driver.lock:
            self._driver.expected[request_id] = None
        self._driver.wake()
        return TransferGrant(grant.incarnation, grant.deadline_unix)

    async def wait_complete(self, request_id: str) -> bytes:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._driver.lock:
            if request_id not in self._driver.expected:
                raise TransferError(f"request {request_id}: no transfer is expected for it")
            self._driver.expected[request_id] = (loop, future)
        self._driver.wake()
        return await future

    def release(self, request_id: str) -> None:
        with self._driver.lock:
            self._driver.expected.pop(request_id, None)
        self.connector.release(request_id)

    def num_open(self) -> int:
        return len(self.connector.active_reservations())

    # -- sender (prefill) ---------------------------------------------------------------
    def begin(self, request_id: str, target: TransferTarget, num_prompt_tokens: int) -> None:
        ep, grant = target.endpoint, target.grant
        if grant is None or not ep.agent_name:
            raise TransferError(f"request {request_id}: the Prefill call carries no transfer grant")
        known = self.connector.peer(ep.agent_name)
        if known is None or known.incarnation != grant.incarnation:
            try:
                meta = AgentMetadata.from_bytes(ep.agent_metadata)
            except (ValueError, KeyError, TypeError) as error:
                raise TransferError(f"request {request_id}: unreadable agent metadata from "
                                    f"{ep.agent_name}: {error}") from None
            self.connector.add_peer(meta)        # LayoutMismatchError names the differing fields
            log.info("KV transfer: handshake with %s (incarnation %s)", meta.name, meta.incarnation[:12])
        num_blocks = -(-num_prompt_tokens // self.block_size)
        if len(target.block_ids) != num_blocks or not 0 <= target.num_cached_blocks < num_blocks:
            raise TransferError(f"request {request_id}: {len(target.block_ids)} destination blocks "
                                f"({target.num_cached_blocks} cached) for a {num_prompt_tokens}-token prompt")
        skipped = target.num_cached_blocks
        reservation = Reservation(request_id, ep.agent_name, grant.incarnation,
                                  tuple(target.block_ids[skipped:]), grant.deadline_unix)
        send = _Send(reservation, list(target.block_ids), skipped, num_prompt_tokens,
                     [skipped] * self.connector.layout.num_layers)
        with self._driver.lock:
            if request_id in self._driver.sends:
                raise TransferError(f"request {request_id} is already being sent")
            self._driver.sends[request_id] = send
        self._driver.wake()

    def on_layer_ready(self, ready: LayerReady) -> None:
        send = self._driver.sends.get(ready.request_id)
        if send is None or send.error is not None:
            return
        final = ready.num_tokens >= send.num_prompt_tokens
        end = -(-ready.num_tokens // self.block_size) if final else ready.num_tokens // self.block_size
        start = send.next_block[ready.layer]
        if end <= start:
            return
        offset = start - ready.first_block
        src = ready.block_ids[offset:offset + end - start]
        try:
            if offset < 0 or len(src) != end - start:
                raise TransferError(f"request {ready.request_id}: layer {ready.layer} reported blocks "
                                    f"{ready.first_block}.. but blocks {start}..{end} are due")
            handle = self.connector.write_layer(send.grant, ready.layer, src, send.dst_block_ids[start:end])
        except TransferError as error:
            send.error = error
            return
        except ValueError as error:
            send.error = TransferError(f"request {ready.request_id}: {error}")
            return
        send.next_block[ready.layer] = end
        send.writes.append(handle)

    async def finish(self, request_id: str, payload: bytes) -> None:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._driver.lock:
            send = self._driver.sends.get(request_id)
            if send is None:
                raise TransferError(f"request {request_id}: nothing is being sent for it")
            num_blocks = len(send.dst_block_ids)
            if send.error is None and any(n != num_blocks for n in send.next_block):
                send.error = TransferError(f"request {request_id}: the prefill ended before every "
                                           "layer of every block was posted")
            send.payload = payload
            send.waiter = (loop, future)
        self._driver.wake()
        await future

    def abandon(self, request_id: str) -> None:
        with self._driver.lock:
            self._driver.sends.pop(request_id, None)
        self.connector.forget_request(request_id)

    def close(self) -> None:
        self._driver.stop()
        self.connector.close()
