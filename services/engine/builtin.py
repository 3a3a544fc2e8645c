"""The built-in torch engine behind the engine contract (services/engine_api/contract.py).

`BuiltinEngine` drives one `LLMEngine` (engine.py: the step loop, its scheduler, block pool and
KV tiers) and answers what a worker asks of any engine: its description and load, how many
prompt tokens it holds, its KV transfer (a connector per tensor-parallel rank, on each rank's
KV pool: rank_connectors.py) and the shared store (kv_tiers/store_client.py). The request
calls pass straight through to `LLMEngine`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from splitserve.block_hashes import block_hashes, salted_key
from splitserve.kvtransfer import KVLayout
from splitserve.kvtransfer.sender_receiver import LayerCallback
from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.engine_api.contract import (EngineDescription, EngineLoad, Fork, KVStoreSettings,
                                                     KVTierLoad, KVTransfer, RankGroup, Reservation,
                                                     TransferSettings)
from splitserve.services.engine_api.kv_events import KVEvent
from splitserve.services.worker_protocol.outputs import RequestOutput, SampledToken
from splitserve.services.worker_protocol.sampling_params import SamplingParams


class BuiltinEngine:
    """An `Engine` over one loaded `LLMEngine` (`core`)."""

    def __init__(self, core: LLMEngine):
        self.core = core
        cfg = core.config
        self._description = EngineDescription(
            model_name=cfg.model_name, max_model_len=core.max_model_len, vocab_size=core.model_config.vocab_size,
            block_size=cfg.block_size, num_kv_blocks=cfg.num_kv_blocks,
            dtype=str(cfg.torch_dtype()).removeprefix("torch."), device=cfg.device,
            tensor_parallel_size=cfg.tensor_parallel_size, block_hash_extra_key=core.scheduler.extra_key,
            max_logprobs=cfg.max_logprobs, fingerprint=core.fingerprint.text())

    @classmethod
    def start(cls, config: EngineConfig) -> BuiltinEngine:
        """Load the model and build the KV cache (blocking)."""
        return cls(LLMEngine(config))

    def describe(self) -> EngineDescription:
        return self._description

    def load(self) -> EngineLoad:
        core = self.core
        pool, sched = core.pool, core.scheduler
        tiers = core.tiers
        tier_loads: tuple[KVTierLoad, ...] = ()
        rejections: dict[str, int] = {}
        if tiers is not None:
            st = tiers.stats
            tier_loads = tuple(KVTierLoad(tier, held, capacity, st.hits[tier], st.bytes_loaded[tier],
                                          st.load_seconds[tier], st.written_down[tier], st.evicted[tier])
                               for tier, (held, capacity) in tiers.occupancy().items())
            rejections = dict(tiers.rejections())
        return EngineLoad(
            num_kv_blocks=pool.num_blocks, num_used_kv_blocks=pool.num_used_blocks,
            num_cached_kv_blocks=len(pool.cached), num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_remote_prefill=len(sched.remote), num_remote_prefill_kv_blocks=sched.num_remote_blocks,
            num_held_prefills=core.num_held_requests, num_fenced_kv_blocks=core.num_fenced_blocks,
            counters=replace(core.stats), kv_tiers=tier_loads, kv_tier_rejections=rejections)

    @property
    def ranks(self) -> RankGroup | None:
        return self.core.tp

    # -- requests ----------------------------------------------------------------
    def prepare(self, params: SamplingParams) -> None:
        if params.structured is not None:
            self.core.structured_outputs.compile(params.structured)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    forks: Sequence[Fork] = (), prefill_only: bool = False,
                    on_layer_done: LayerCallback | None = None) -> None:
        self.core.add_request(request_id, prompt_token_ids, params, prefill_only=prefill_only,
                              on_layer_done=on_layer_done, forks=list(forks))

    def abort(self, request_id: str) -> bool:
        return self.core.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        return self.core.step()

    # -- disaggregated prefill: the decode side ------------------------------------
    def num_cached_prompt_tokens(self, token_ids: list[int], cache_salt: str = "") -> int:
        core = self.core
        bs = core.config.block_size
        hashes = block_hashes(token_ids, bs, salted_key(core.scheduler.extra_key, cache_salt))
        hits = len(core.pool.cached_prefix(hashes))
        if core.tiers is not None:
            hits += core.tiers.lookup(hashes[hits:])
        return hits * bs

    def reserve_remote_prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                               fence_writes: bool = False, forks: Sequence[Fork] = ()) -> Reservation | None:
        return self.core.reserve_remote_prefill(request_id, prompt_token_ids, params, fence_writes=fence_writes,
                                                forks=list(forks))

    def complete_remote_prefill(self, request_id: str, first_token: int | SampledToken,
                                prompt_logprobs: list[SampledToken] | None = None) -> RequestOutput | None:
        return self.core.complete_remote_prefill(request_id, first_token, prompt_logprobs)

    def cancel_remote_prefill(self, request_id: str) -> bool:
        return self.core.cancel_remote_prefill(request_id)

    def release_transfer(self, request_id: str) -> bool:
        return self.core.release_transfer(request_id)

    # -- live migration (contract.KVMigrationEngine) ------------------------------------
    def suspend(self, request_id: str) -> int | None:
        return self.core.suspend(request_id)

    def export_suspended(self, request_id: str, transfer_id: str, token_ids: list[int],
                         on_layer_done: LayerCallback) -> int:
        return self.core.export_suspended(request_id, transfer_id, token_ids, on_layer_done)

    def release_suspended(self, request_id: str) -> bool:
        return self.core.release_suspended(request_id)

    def reserve_migration(self, request_id: str, token_ids: list[int], params: SamplingParams
                          ) -> Reservation | None:
        return self.core.reserve_migration(request_id, token_ids, params)

    def complete_migration(self, request_id: str) -> RequestOutput | None:
        return self.core.complete_migration(request_id)

    # -- KV events ---------------------------------------------------------------
    def subscribe_events(self, callback: Callable[[list[KVEvent]], None]) -> None:
        self.core.subscribe_events(callback)

    def wake_on_store_events(self, wake: Callable[[], None]) -> None:
        self.core.wake_on_store_events(wake)

    def flush_store_events(self) -> None:
        self.core.flush_store_events()

    # -- wiring ------------------------------------------------------------------
    def build_kv_transfer(self, settings: TransferSettings) -> KVTransfer:
        from splitserve.kvtransfer.backends import resolve_backend
        from splitserve.services.engine.rank_connectors import RankKVPools, build_connector_transfer

        core = self.core
        pools = RankKVPools(kv_layout(core), core.runner.kv.tensor, core.config.tensor_parallel_size,
                            core.tp.control if core.tp is not None else None)
        return build_connector_transfer(resolve_backend(settings.backend), settings.name, pools, settings.host,
                                        settings.token, settings.advertise_host)

    def attach_kv_store(self, store: KVStoreSettings, transfer: TransferSettings) -> None:
        from splitserve.services.engine.kv_tiers.store_client import StoreClient
        from splitserve.kvtransfer.backends import resolve_backend

        client = StoreClient(store.address, kv_layout(self.core), resolve_backend(transfer.backend), transfer.name,
                             transfer.host, transfer.token, transfer.advertise_host, etcd=list(store.etcd),
                             etcd_tls=store.etcd_tls)
        try:
            self.core.attach_store(client)
        except BaseException:
            client.close()
            raise

    def close(self) -> None:
        self.core.close()


def kv_layout(core: LLMEngine) -> KVLayout:
    """The whole model's KV layout, as the transfer handshake compares it (before any TP split)."""
    mc, cfg = core.model_config, core.config
    return KVLayout(model=f"{cfg.model_name}|{cfg.extra_cache_key}", dtype=str(cfg.torch_dtype()).removeprefix("torch."),
                    num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                    block_size=cfg.block_size, fingerprint=core.fingerprint.text())


@dataclass(frozen=True, slots=True)
class BuiltinEngineLauncher:
    """Starts the built-in engine with `config` (the worker's `EngineLauncher`)."""

    config: EngineConfig

    @property
    def model(self) -> str:
        return self.config.model

    def launch(self) -> BuiltinEngine:
        return BuiltinEngine.start(self.config)
