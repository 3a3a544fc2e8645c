"""What splitserve's KV connector inside vLLM and `VllmEngine` share in one worker process.

vLLM builds its KV connector itself, twice (one instance in its scheduler, one in its model
runner) from `kv_transfer_config`; with `VLLM_ENABLE_V1_MULTIPROCESSING=0` and one rank both
live in the worker's process, on the engine thread. `TransferBook` is the one object the
engine and both halves read and write (kv_connector.py finds it through `book()`): which
requests are remote prompts the decode side waits for, which are prefill-only sends and the
callback each layer goes to, and which requests' blocks the connector holds after vLLM
finished them until splitserve's transfer says it is done (`release`, vLLM's `get_finished`).

Imports nothing of vLLM, so its bookkeeping is unit-tested on its own.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from splitserve.kvtransfer.sender_receiver import LayerCallback

RECEIVE, SEND = "receive", "send"
PARAMS_KEY = "splitserve"          # kv_transfer_params[PARAMS_KEY] = {"role": ..., "id": ...}


def transfer_params(role: str, request_id: str) -> dict[str, Any]:
    """vLLM's `kv_transfer_params` that mark a request as one of splitserve's transfers."""
    return {PARAMS_KEY: {"role": role, "id": request_id}}


def marked(kv_transfer_params: dict[str, Any] | None) -> tuple[str, str] | None:
    """(role, splitserve request id) of a request `transfer_params` marked; None otherwise."""
    mark = (kv_transfer_params or {}).get(PARAMS_KEY)
    if not isinstance(mark, dict) or mark.get("role") not in (RECEIVE, SEND):
        return None
    return mark["role"], str(mark["id"])


@dataclass(slots=True)
class Transfer:
    """One request's transfer, on either side."""

    role: str                                  # RECEIVE (decode side) | SEND (prefill side)
    request_id: str                            # splitserve's (vLLM's external id)
    internal_id: str = ""                      # vLLM's own id, known once its scheduler saw it
    on_layer_done: LayerCallback | None = None  # SEND: the sender's per-layer hook
    block_ids: list[int] | None = None         # RECEIVE: the blocks vLLM allocated for the prompt
    num_local_tokens: int = 0                  # RECEIVE: leading prompt tokens vLLM had cached
    received: bool = False                     # RECEIVE: the KV is in place (decode goes on)
    held: bool = False                         # vLLM finished it; its blocks wait for `release`
    released: bool = False                     # splitserve's transfer is done with its blocks
    num_held_blocks: int = 0


@dataclass(frozen=True, slots=True)
class TransferCounts:
    """The engine's load, as far as transfers hold blocks."""

    num_waiting_receives: int           # remote prompts whose blocks wait for a prefill worker's KV
    num_waiting_receive_blocks: int
    num_held_sends: int                 # finished prefill-only requests a sender may still read
    num_held_receive_blocks: int        # given-up reservations' blocks a writer may still reach


@dataclass(frozen=True, slots=True)
class LayerSend:
    """One prefill-only request's share of one step: after each layer, its KV for the first
    `num_tokens` prompt tokens is written in `block_ids` (the request's blocks from block 0)."""

    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(slots=True)
class TransferBook:
    """See the module docstring. Every method takes the lock: vLLM calls its connector on the
    engine thread, the worker's fences may release from elsewhere through the engine loop."""

    _by_id: dict[tuple[str, str], Transfer] = field(default_factory=dict)     # (role, request id)
    _by_internal: dict[str, Transfer] = field(default_factory=dict)
    _finished_sending: set[str] = field(default_factory=set)                # internal ids to report
    _finished_recving: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- the engine -------------------------------------------------------------------
    def expect_receive(self, request_id: str) -> Transfer:
        with self._lock:
            return self._add(Transfer(RECEIVE, request_id))

    def expect_send(self, request_id: str, on_layer_done: LayerCallback) -> Transfer:
        with self._lock:
            return self._add(Transfer(SEND, request_id, on_layer_done=on_layer_done))

    def _add(self, transfer: Transfer) -> Transfer:
        key = (transfer.role, transfer.request_id)
        if key in self._by_id:
            raise ValueError(f"request {transfer.request_id!r} already has a {transfer.role} transfer")
        self._by_id[key] = transfer
        return transfer

    def mark_received(self, request_id: str) -> bool:
        """The remote prompt's KV is in place: vLLM's next step takes the request up (its
        `get_finished` reports the receive). False when no such transfer waits."""
        with self._lock:
            t = self._by_id.get((RECEIVE, request_id))
            if t is None or t.received or t.held or not t.internal_id:
                return False
            t.received = True
            self._finished_recving.add(t.internal_id)
            self._forget(t)          # from now on vLLM frees its blocks the usual way
            return True

    def release(self, request_id: str) -> bool:
        """splitserve's transfer is done with the request's blocks (sent, or fenced). A request
        vLLM already finished is reported to its scheduler, which frees the blocks; one it has
        not finished yet keeps its blocks the usual way. False when nothing was held for it."""
        with self._lock:
            released = False
            for role in (SEND, RECEIVE):
                t = self._by_id.get((role, request_id))
                if t is None or (role == RECEIVE and t.received):
                    continue
                t.released = released = True
                if t.held:
                    (self._finished_sending if role == SEND else self._finished_recving).add(t.internal_id)
                    self._forget(t)
            return released

    def forget(self, role: str, request_id: str) -> None:
        """Drop a transfer vLLM never allocated blocks for (a reservation it could not admit)."""
        with self._lock:
            t = self._by_id.get((role, request_id))
            if t is not None:
                self._forget(t)

    def _forget(self, t: Transfer) -> None:
        if self._by_id.get((t.role, t.request_id)) is t:
            del self._by_id[(t.role, t.request_id)]
        if t.internal_id and self._by_internal.get(t.internal_id) is t:
            del self._by_internal[t.internal_id]

    def counts(self) -> TransferCounts:
        with self._lock:
            waiting = [t for t in self._by_id.values()
                       if t.role == RECEIVE and t.block_ids is not None and not t.received and not t.held]
            held = [t for t in self._by_id.values() if t.held]
            return TransferCounts(
                num_waiting_receives=len(waiting), num_waiting_receive_blocks=sum(len(t.block_ids) for t in waiting),
                num_held_sends=sum(1 for t in held if t.role == SEND),
                num_held_receive_blocks=sum(t.num_held_blocks for t in held if t.role == RECEIVE))

    def has_finished(self) -> bool:
        """Completions vLLM's scheduler has not heard of yet (its next step reports them)."""
        with self._lock:
            return bool(self._finished_sending or self._finished_recving)

    # -- vLLM's scheduler-side connector --------------------------------------------------
    def seen(self, role: str, request_id: str, internal_id: str) -> Transfer | None:
        """vLLM's scheduler met the request under `internal_id`."""
        with self._lock:
            t = self._by_id.get((role, request_id))
            if t is not None and not t.internal_id:
                t.internal_id = internal_id
                self._by_internal[internal_id] = t
            return t

    def allocated(self, internal_id: str, block_ids: list[int], num_local_tokens: int) -> None:
        with self._lock:
            t = self._by_internal.get(internal_id)
            if t is not None and t.role == RECEIVE and t.block_ids is None:
                t.block_ids, t.num_local_tokens = list(block_ids), num_local_tokens

    def sends(self) -> list[Transfer]:
        with self._lock:
            return [t for t in self._by_id.values() if t.role == SEND and t.internal_id and not t.held]

    def finished(self, internal_id: str, num_blocks: int) -> bool:
        """vLLM finished the request, which holds `num_blocks` blocks: True when they stay until
        `release` (a send whose writes may still read them, a receive whose writes may still land)."""
        with self._lock:
            t = self._by_internal.get(internal_id)
            if t is None:
                return False
            if t.released or (t.role == RECEIVE and (t.received or t.block_ids is None)):
                self._forget(t)
                return False
            t.held, t.num_held_blocks = True, num_blocks
            return True

    # -- vLLM's worker-side connector ------------------------------------------------------
    def callback(self, request_id: str) -> LayerCallback | None:
        with self._lock:
            t = self._by_id.get((SEND, request_id))
            return None if t is None else t.on_layer_done

    def take_finished(self) -> tuple[set[str], set[str]]:
        """(sends, receives) whose blocks vLLM's scheduler may free now; once each."""
        with self._lock:
            out = (self._finished_sending, self._finished_recving)
            self._finished_sending, self._finished_recving = set(), set()
            return out
