"""`SplitserveConnector`: splitserve's KV transfer inside vLLM, as a vLLM KV connector (issue 39).

vLLM loads it from `kv_transfer_config` (`kv_connector="SplitserveConnector"`,
`kv_connector_module_path="splitserve.services.engine_vllm.kv_connector"`; launcher.py sets
both for a prefill or decode worker) and builds two instances in the worker's process: one in
its scheduler, one in its model runner. Both reach `VllmEngine` through the process's
`TransferBook` (transfer_book.py). splitserve's own protocol does the moving: grants, write
fences, the layer-wise push over NIXL or TCP (kvtransfer/), the Prefill call
(services/worker/kv/); this module only turns vLLM's hooks into it.

Decode side. `VllmEngine.reserve_remote_prefill` adds the request marked RECEIVE; at its first
schedule `get_num_new_matched_tokens` claims the whole uncached prompt as an asynchronous load,
vLLM allocates its blocks and `update_state_after_alloc` records them: those are the
reservation's blocks, granted to the prefill worker. The request then sits in vLLM's
WAITING_FOR_REMOTE_KVS until the transfer's notification arrives and the engine marks it
received; `get_finished` reports it, and vLLM recomputes the prompt's last token and samples the
first token itself (its own rule for remote KV), so seeded sampling draws as aggregated does. A
request vLLM finishes while its blocks may still be written (aborted during the transfer)
keeps them (`request_finished` → delay) until the worker's write fence releases it.

Prefill side. A prefill-only request is added marked SEND with the sender's per-layer callback;
`build_connector_meta` lists each such request scheduled in a step with its blocks and the
prompt tokens complete after the step, and `save_kv_layer`, which vLLM calls after each
attention layer, hands that layer to the sender, which posts its writes while the next layer
computes. Its blocks stay after the request finished until the send is over.

vLLM's KV cache is one buffer, each layer `[blocks][kv_heads][block_size][2 * head_dim]` (K
rows then V rows per head), layers one after another: kvtransfer's paged layout.
`register_kv_caches` checks that and views the buffer as
`[layers][blocks][kv_heads][2][block_size][head_dim]`.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

from splitserve.kvtransfer.sender_receiver import LayerReady
from splitserve.services.engine_vllm.transfer_book import RECEIVE, SEND, LayerSend, TransferBook, marked

log = logging.getLogger(__name__)

MODULE_PATH = __name__
CLASS_NAME = "SplitserveConnector"

_book = TransferBook()
_pool_lock = threading.Lock()
_pool: PagedPool | None = None


def book() -> TransferBook:
    """The process's transfer book (one vLLM engine per worker process)."""
    return _book


@dataclass(frozen=True, slots=True)
class PagedPool:
    """vLLM's KV buffer as `[layers][blocks][kv_heads][2][block_size][head_dim]`, and each
    attention layer's index in it."""

    tensor: torch.Tensor
    layer_index: dict[str, int]


def registered_pool() -> PagedPool | None:
    with _pool_lock:
        return _pool


def paged_pool(kv_caches: dict[str, torch.Tensor]) -> PagedPool:
    """The one buffer behind vLLM's per-layer KV tensors; ValueError when they are not one buffer
    of consecutive layers of the CPU attention backend's shape."""
    if not kv_caches:
        raise ValueError("vLLM registered no KV caches")
    layers = sorted(kv_caches.items(), key=lambda item: item[1].data_ptr())
    first = layers[0][1]
    if first.dim() != 4 or first.shape[-1] % 2 or not first.is_contiguous():
        raise ValueError(f"vLLM's KV cache per layer is {tuple(first.shape)}; splitserve's connector moves "
                         "[blocks][kv_heads][block_size][2 * head_dim] pages (vLLM's CPU attention layout)")
    layer_bytes = first.numel() * first.element_size()
    for i, (name, t) in enumerate(layers):
        if (t.shape != first.shape or t.dtype != first.dtype or t.data_ptr() != first.data_ptr() + i * layer_bytes
                or not t.is_contiguous()):
            raise ValueError(f"vLLM's KV cache layer {name} is not the next layer of one buffer; splitserve's "
                             "connector needs vLLM's one-buffer KV layout (LBHNC)")
    num_blocks, heads, block_size, two_head_dim = first.shape
    shape = (len(layers), num_blocks, heads, 2, block_size, two_head_dim // 2)
    view = torch.empty(0, dtype=first.dtype, device=first.device).set_(
        first.untyped_storage(), first.storage_offset(), shape)
    return PagedPool(view, {name: i for i, (name, _) in enumerate(layers)})


class SplitserveMetadata(KVConnectorMetadata):
    """One step's prefill-only requests (scheduler → model runner)."""

    def __init__(self, sends: list[LayerSend]):
        self.sends = sends


class SplitserveConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
            raise ValueError("splitserve's KV connector runs vLLM with one rank for now (--tp 1): vLLM's other "
                             "ranks run in processes of their own, which its transfer does not reach yet")
        self._book = book()
        self._sends: dict[str, Any] = {}           # scheduler: vLLM id → Request of a prefill-only request
        self._layers: dict[str, int] = {}

    # -- model runner ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        global _pool
        pool = paged_pool(kv_caches)
        self._layers = pool.layer_index
        with _pool_lock:
            _pool = pool
        log.info("splitserve KV connector: %d layers of %d blocks registered (%s, %.0f MiB)", pool.tensor.shape[0],
                 pool.tensor.shape[1], str(pool.tensor.dtype).removeprefix("torch."),
                 pool.tensor.numel() * pool.tensor.element_size() / 2**20)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Nothing to load: the prefill worker pushes the KV before the request is scheduled."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for (see start_load_kv)."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        sends = self._get_connector_metadata().sends
        if not sends:
            return
        layer = self._layers[layer_name]
        for send in sends:
            callback = self._book.callback(send.request_id)
            if callback is not None:      # the sender never raises (it reports at finish)
                callback(LayerReady(send.request_id, layer, 0, list(send.block_ids), send.num_tokens))

    def wait_for_save(self) -> None:
        """Writes complete asynchronously: a send's blocks are held until its transfer releases them."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self._book.take_finished()
        return sending or None, recving or None

    # -- scheduler ---------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        mark = marked(request.kv_transfer_params)
        if mark is not None and mark[0] == SEND and self._book.seen(SEND, mark[1], request.request_id) is not None:
            self._sends[request.request_id] = request

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        mark = marked(request.kv_transfer_params)
        if mark is None or mark[0] != RECEIVE:
            return 0, False
        transfer = self._book.seen(RECEIVE, mark[1], request.request_id)
        if transfer is None or transfer.block_ids is not None:
            return 0, False
        return len(request.prompt_token_ids) - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._book.allocated(request.request_id, list(blocks.get_block_ids()[0]),
                                 len(request.prompt_token_ids) - num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> SplitserveMetadata:
        sends = []
        scheduled = scheduler_output.num_scheduled_tokens
        for transfer in self._book.sends():
            request = self._sends.get(transfer.internal_id)
            num_new = scheduled.get(transfer.internal_id, 0)
            if request is None or not num_new:
                continue
            blocks = self._kv_cache_manager.get_block_ids(transfer.internal_id)[0]
            sends.append(LayerSend(transfer.request_id, tuple(blocks), request.num_computed_tokens + num_new))
        return SplitserveMetadata(sends)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._sends.pop(request.request_id, None)
        return self._book.finished(request.request_id, len(block_ids)), None

    def has_pending_push_work(self) -> bool:
        return self._book.has_finished()
