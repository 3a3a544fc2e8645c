"""The engine contract: everything a worker knows about the engine it serves.

A worker (services/worker/) hosts one engine behind the gRPC Worker service: it adds requests
as token ids with their sampling parameters, streams each request's `RequestOutput`s, aborts
them, reserves blocks for a prompt a prefill worker fills and completes it with the first
token, reads the engine's load and KV layout, and republishes its KV events. It does all of
that through `Engine` and the types here, and imports nothing else of any engine. The built-in
torch engine implements it (services/engine/builtin.py); so does the stand-in engine of the
worker's unit tests (splitserve/testing/fake_engine.py).

The contract follows vLLM's split, so that a vLLM engine can implement it too: token ids in
and out (text, stop strings, tools and chat templates stay in the frontend), one synchronous
`step()` that returns what each request produced (vLLM's `LLMEngine.step`), `abort`, and
per-request KV-transfer hooks (vLLM's KV connector: the prefill side reports each layer, the
decode side's blocks stay owned by the transfer until `release_transfer`, vLLM's
`request_finished` / `get_finished`).

Threading: every method runs on the worker's engine thread (services/worker/engine_loop.py),
between steps, except `prepare` (any thread, may block) and the callbacks that
`wake_on_store_events` installs (called from any thread).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from splitserve.kvtransfer.sender_receiver import KVReceiver, KVSender, LayerCallback
from splitserve.services.engine_api.kv_events import KVEvent
from splitserve.services.worker_protocol.outputs import RequestOutput, SampledToken
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.tls import PLAINTEXT, TlsConfig

Fork = tuple[str, SamplingParams]     # (request id, parameters) of one more sample of a prompt


@dataclass(frozen=True, slots=True)
class EngineDescription:
    """What a loaded engine serves and how its KV cache is laid out (the Describe RPC)."""

    model_name: str
    max_model_len: int              # prompt + output tokens one request may hold
    vocab_size: int
    block_size: int                 # tokens per KV block: the router hashes prompts in these blocks
    num_kv_blocks: int
    dtype: str                      # the KV cache's dtype, e.g. "float32"
    device: str
    tensor_parallel_size: int
    block_hash_extra_key: bytes     # splitserve/block_hashes.py's extra key: model, dtype, engine options
    max_logprobs: int = 20          # vLLM's --max-logprobs: most logprobs per token a request may ask; -1: all
    # The engine's own KV connector moves prompts' KV between prefill and decode workers (a
    # `KVHandoffEngine`; "nixl-vllm": vLLM's NixlConnector); "": splitserve's kvtransfer does.
    kv_handoff: str = ""
    # What a worker that exchanges KV with this one must equal: weights, tokenizer, engine
    # (splitserve/checkpoints/fingerprint.py `Fingerprint.text()`); "": not known.
    fingerprint: str = ""


@dataclass(frozen=True, slots=True)
class KVTierLoad:
    """One KV tier below the block pool (host memory, disk, the shared store)."""

    tier: str
    num_blocks: int
    capacity_blocks: int
    num_hits: int = 0               # blocks loaded back into the pool
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    num_written: int = 0            # blocks written down into it
    num_evicted: int = 0


@dataclass(slots=True)
class EngineCounters:
    """Monotonic counts since the engine started."""

    num_steps: int = 0
    num_computed_tokens: int = 0        # tokens run through the model (prompt + generated)
    num_prompt_tokens_computed: int = 0
    num_prefix_hit_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_forks: int = 0                  # samples that took a sibling's prompt KV instead of prefilling
    num_forked_blocks: int = 0          # full KV blocks those forks shared by reference
    num_fork_copies: int = 0            # partial last blocks copied for them (copy-on-write)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The engine's load now: what the router, the planner and /metrics read (the Stats RPC)."""

    num_kv_blocks: int
    num_used_kv_blocks: int
    num_cached_kv_blocks: int           # free blocks that still hold a reusable prefix
    num_running: int
    num_waiting: int
    num_remote_prefill: int             # requests whose blocks wait for a prefill worker's KV
    num_remote_prefill_kv_blocks: int   # the blocks those hold
    num_held_prefills: int              # finished prefill-only requests a sender still reads
    num_fenced_kv_blocks: int           # given-up reservations' blocks a writer may still reach
    counters: EngineCounters
    kv_tiers: tuple[KVTierLoad, ...] = ()
    kv_tier_rejections: dict[str, int] = field(default_factory=dict)   # reason → blocks dropped on load


@dataclass(slots=True)
class Reservation:
    """Blocks a decode worker holds for a prompt that a prefill worker fills."""

    block_ids: list[int]
    num_cached_tokens: int      # leading prompt tokens already in those blocks locally


@dataclass(frozen=True, slots=True)
class TransferSettings:
    """How an engine's KV transfer connects: the backend, this worker's name and addresses, the
    shared secret peers must prove (kvtransfer/auth.py)."""

    backend: str = "auto"                 # auto | nixl | tcp
    name: str = "worker"
    host: str = "127.0.0.1"
    token: bytes = b""
    advertise_host: str | None = None


@dataclass(frozen=True, slots=True)
class KVStoreSettings:
    """The shared KV block store to attach to (`splitserve kvstore`)."""

    address: str                          # HOST:PORT, or "etcd": the store registered in `etcd`
    etcd: tuple[str, ...] = ()
    etcd_tls: TlsConfig = PLAINTEXT


class KVTransfer(KVSender, KVReceiver, Protocol):
    """Both halves of an engine's KV transfer (a worker uses the half its role needs)."""


class RankGroup(Protocol):
    """An engine that runs on several processes (tensor-parallel ranks), which fail together."""

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Call `on_lost(why)` (from any thread) once a rank is gone."""

    def step_failed(self, exc: BaseException) -> None:
        """A step failed: the ranks may be out of step, so the group is lost (its watchers hear
        why: the rank that is gone, when one is, else `exc`)."""


@runtime_checkable
class Engine(Protocol):
    """One engine behind a worker. See the module docstring for threading."""

    def describe(self) -> EngineDescription: ...

    def load(self) -> EngineLoad: ...

    @property
    def ranks(self) -> RankGroup | None:
        """The process group when the engine spans several processes; None for one process."""

    # -- requests ----------------------------------------------------------------
    def prepare(self, params: SamplingParams) -> None:
        """Work a request needs before it is queued that must not hold up a step (compiling a
        structured-output grammar). Any thread; raises InvalidRequestError for bad parameters."""

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    forks: Sequence[Fork] = (), prefill_only: bool = False,
                    on_layer_done: LayerCallback | None = None) -> None:
        """Queue a request. `forks`: more samples of the same prompt (each a request of its own
        from then on). `prefill_only`: compute the prompt and its first token, call
        `on_layer_done` after each layer with the blocks written, and keep the blocks for the
        sender until `release_transfer`. Raises InvalidRequestError for a request it refuses."""

    def abort(self, request_id: str) -> bool:
        """Drop a request now (its blocks are free before the next step; an open stream gets a
        final ABORT output). False if unknown."""

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestOutput]:
        """Run one scheduling decision and return what each request produced."""

    # -- disaggregated prefill: the decode side ------------------------------------
    def num_cached_prompt_tokens(self, token_ids: list[int], cache_salt: str = "") -> int:
        """Leading prompt tokens this engine holds now, in its pool or loadable from its tiers."""

    def reserve_remote_prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                               fence_writes: bool = False, forks: Sequence[Fork] = ()) -> Reservation | None:
        """Hold blocks for a prompt a prefill worker will fill; None when the pool is short.
        `fence_writes`: a given-up reservation's blocks stay out of the pool until
        `release_transfer`."""

    def complete_remote_prefill(self, request_id: str, first_token: int | SampledToken,
                                prompt_logprobs: list[SampledToken] | None = None) -> RequestOutput | None:
        """The reserved blocks hold the prompt's KV: decode goes on from `first_token`. None when
        the reservation is gone (aborted meanwhile)."""

    def cancel_remote_prefill(self, request_id: str) -> bool:
        """Give a reservation back without output (to prefill locally instead)."""

    def release_transfer(self, request_id: str) -> bool:
        """The transfer is done with the request's blocks: free them. False if it held none."""

    # -- KV events ---------------------------------------------------------------
    def subscribe_events(self, callback: Callable[[list[KVEvent]], None]) -> None:
        """Call `callback` with each batch of KV events, in order, after every step."""

    def wake_on_store_events(self, wake: Callable[[], None]) -> None:
        """Call `wake` (any thread) when events from below the engine (the shared store) wait; the
        worker then calls `flush_store_events` on the engine thread."""

    def flush_store_events(self) -> None: ...

    # -- wiring ------------------------------------------------------------------
    def build_kv_transfer(self, settings: TransferSettings) -> KVTransfer:
        """Both halves of the KV transfer over this engine's KV memory (every rank's)."""

    def attach_kv_store(self, store: KVStoreSettings, transfer: TransferSettings) -> None:
        """Fetch prefixes from, and publish computed blocks to, the shared KV block store."""

    def close(self) -> None: ...


@runtime_checkable
class KVHandoffEngine(Protocol):
    """An engine whose own KV connector moves a prompt's KV between a prefill and a decode worker
    (`EngineDescription.kv_handoff`): the prefill side's final output carries the connector's
    handoff (`RequestOutput.kv_handoff`, opaque to splitserve, JSON-serializable), which the
    decode side's engine is given to fetch the KV (vLLM's `kv_transfer_params`). Blocks, leases,
    failures and recompute are the connector's (services/worker/kv/handoff.py)."""

    def add_handoff_prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Prefill side: the prompt and one token; the last output (PREFILL_DONE) has `kv_handoff`."""

    def add_handed_off(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       kv_handoff: dict, *, forks: Sequence[Fork] = (),
                       prompt_logprobs: list[SampledToken] | None = None) -> None:
        """Decode side: a request whose prompt KV the connector fetches as `kv_handoff` says
        (recomputed where it cannot); `prompt_logprobs`, the prefill side's, come with the first
        output."""


@runtime_checkable
class KVMigrationEngine(Protocol):
    """An engine whose running requests can move to another decode worker with their KV (live
    migration; the built-in engine). The source suspends the request and reports its blocks to a
    sender as a prefill reports its layers; the destination reserves blocks for the request's
    tokens, receives the KV of all but the last one and computes that one itself (so it samples
    the next token with its own generator, as after a local prefill). An engine without it
    migrates by token replay (services/frontend/migration.py)."""

    def suspend(self, request_id: str) -> int | None:
        """Source: stop decoding `request_id`, keep its KV blocks (its stream ends); how many
        tokens' KV they hold, or None when the request cannot be suspended."""

    def export_suspended(self, request_id: str, transfer_id: str, token_ids: list[int],
                         on_layer_done: LayerCallback) -> int:
        """Source: report each layer of the blocks holding the KV of the first len(token_ids) - 1
        tokens to `on_layer_done` under `transfer_id`; raises InvalidRequestError when the
        suspended request's tokens differ or nothing is held."""

    def release_suspended(self, request_id: str) -> bool:
        """Source: free the suspended request's blocks (read, or its hold expired)."""

    def reserve_migration(self, request_id: str, token_ids: list[int], params: SamplingParams
                          ) -> Reservation | None:
        """Destination: blocks for `token_ids`, granted for the KV of all but the last (fenced as a
        reservation with fence_writes); None when the pool is full."""

    def complete_migration(self, request_id: str) -> RequestOutput | None:
        """Destination: the KV arrived; the last token is computed next step (None: no reservation)."""


class EngineLauncher(Protocol):
    """How a worker starts its engine: `launch` loads the model (blocking; the worker runs it on a
    thread and serves health meanwhile)."""

    @property
    def model(self) -> str:
        """What it loads, as the user named it (for logs)."""

    def launch(self) -> Engine: ...
