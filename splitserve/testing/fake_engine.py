"""A stand-in engine for the worker's unit tests: the engine contract without a model.

`FakeEngine` implements `splitserve.services.engine_api.contract.Engine` with no torch and
no weights: a request's next token is the previous one plus one (mod the vocabulary), every
step advances each running request by one token, and blocks are counted, not stored. It
shows that a worker needs nothing of an engine beyond the contract, and lets tests drive the
worker's paths (streams, aborts, remote prefill, failing steps) with an engine they control.
It is a stand-in, named as such: the real engines' behaviour is tested on real engines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from splitserve.block_hashes import block_hashes
from splitserve.errors import InvalidRequestError
from splitserve.kvtransfer.sender_receiver import LayerCallback, LayerReady
from splitserve.services.engine_api.contract import (EngineCounters, EngineDescription, EngineLoad, Fork,
                                                     KVStoreSettings, KVTransfer, RankGroup, Reservation,
                                                     TransferSettings)
from splitserve.services.engine_api.kv_events import KVEvent, KVEventLog
from splitserve.services.worker_protocol.outputs import FinishReason, RequestOutput, SampledToken
from splitserve.services.worker_protocol.sampling_params import SamplingParams

BLOCK_SIZE = 4


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    prefill_only: bool = False
    on_layer_done: LayerCallback | None = None
    output: list[int] = field(default_factory=list)
    remote: bool = False            # blocks reserved for a prefill worker, not yet filled

    @property
    def num_blocks(self) -> int:
        return -(-(len(self.prompt) + len(self.output)) // BLOCK_SIZE)


class FakeEngine:
    """An `Engine` stand-in (see the module docstring). `fail_next_step` makes one step raise."""

    def __init__(self, num_kv_blocks: int = 64, vocab_size: int = 1000, max_model_len: int = 256,
                 num_layers: int = 2):
        self._description = EngineDescription(
            model_name="fake", max_model_len=max_model_len, vocab_size=vocab_size, block_size=BLOCK_SIZE,
            num_kv_blocks=num_kv_blocks, dtype="float32", device="cpu", tensor_parallel_size=1,
            block_hash_extra_key=b"fake")
        self.num_layers = num_layers
        self.counters = EngineCounters()
        self.fail_next_step = False
        self._running: dict[str, _Request] = {}
        self._held: dict[str, int] = {}              # request id -> blocks a transfer still owns
        self._pending: list[RequestOutput] = []
        self._subscribers: list[Callable[[list[KVEvent]], None]] = []
        self._events = KVEventLog()
        self.closed = False

    # -- what the worker reads -------------------------------------------------------
    def describe(self) -> EngineDescription:
        return self._description

    def load(self) -> EngineLoad:
        used = sum(r.num_blocks for r in self._running.values()) + sum(self._held.values())
        remote = [r for r in self._running.values() if r.remote]
        return EngineLoad(
            num_kv_blocks=self._description.num_kv_blocks, num_used_kv_blocks=used, num_cached_kv_blocks=0,
            num_running=len(self._running) - len(remote), num_waiting=0, num_remote_prefill=len(remote),
            num_remote_prefill_kv_blocks=sum(r.num_blocks for r in remote), num_held_prefills=len(self._held),
            num_fenced_kv_blocks=0, counters=replace(self.counters))

    @property
    def ranks(self) -> RankGroup | None:
        return None

    # -- requests ----------------------------------------------------------------------
    def prepare(self, params: SamplingParams) -> None:
        params.validate()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    forks: Sequence[Fork] = (), prefill_only: bool = False,
                    on_layer_done: LayerCallback | None = None) -> None:
        self._admit(request_id, prompt_token_ids, params, forks)
        self._running[request_id] = _Request(request_id, list(prompt_token_ids), params, prefill_only, on_layer_done)
        for fork_id, fork_params in forks:
            self._running[fork_id] = _Request(fork_id, list(prompt_token_ids), fork_params)

    def abort(self, request_id: str) -> bool:
        request = self._running.pop(request_id, None)
        if request is None:
            return self._held.pop(request_id, None) is not None
        self.counters.num_aborted += 1
        self._pending.append(self._output(request, [], FinishReason.ABORT))
        return True

    def has_unfinished(self) -> bool:
        return any(not r.remote for r in self._running.values())

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("a stand-in step failure")
        active = [r for r in self._running.values() if not r.remote]
        if not active:
            return outputs
        self.counters.num_steps += 1
        for request in active:
            if not request.output:
                self.counters.num_prompt_tokens_computed += len(request.prompt)
                hashes = block_hashes(request.prompt, BLOCK_SIZE, self._description.block_hash_extra_key)
                if hashes:      # the prompt's full blocks, as a real engine's prefix cache keeps them
                    self._events.stored(tuple(hashes), None, tuple(request.prompt[:len(hashes) * BLOCK_SIZE]))
                if request.on_layer_done is not None:
                    for layer in range(self.num_layers):
                        request.on_layer_done(LayerReady(request.request_id, layer, 0,
                                                         list(range(request.num_blocks)), len(request.prompt)))
            outputs.append(self._advance(request, self._next_token(request)))
        self._publish(self._events.take_events())
        return outputs

    # -- disaggregated prefill: the decode side ------------------------------------------
    def num_cached_prompt_tokens(self, token_ids: list[int], cache_salt: str = "") -> int:
        return 0

    def reserve_remote_prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                               fence_writes: bool = False, forks: Sequence[Fork] = ()) -> Reservation | None:
        self._admit(request_id, prompt_token_ids, params, forks)
        request = _Request(request_id, list(prompt_token_ids), params, remote=True)
        if self.load().num_used_kv_blocks + request.num_blocks > self._description.num_kv_blocks:
            return None
        self._running[request_id] = request
        return Reservation(list(range(request.num_blocks)), 0)

    def complete_remote_prefill(self, request_id: str, first_token: int | SampledToken,
                                prompt_logprobs: list[SampledToken] | None = None) -> RequestOutput | None:
        request = self._running.get(request_id)
        if request is None or not request.remote:
            return None
        request.remote = False
        token = first_token.token_id if isinstance(first_token, SampledToken) else first_token
        return self._advance(request, token)

    def cancel_remote_prefill(self, request_id: str) -> bool:
        request = self._running.get(request_id)
        if request is None or not request.remote:
            return False
        del self._running[request_id]
        return True

    def release_transfer(self, request_id: str) -> bool:
        return self._held.pop(request_id, None) is not None

    # -- KV events ---------------------------------------------------------------------
    def subscribe_events(self, callback: Callable[[list[KVEvent]], None]) -> None:
        self._subscribers.append(callback)

    def wake_on_store_events(self, wake: Callable[[], None]) -> None:
        pass                                   # no store below this engine

    def flush_store_events(self) -> None:
        pass

    # -- wiring ------------------------------------------------------------------------
    def build_kv_transfer(self, settings: TransferSettings) -> KVTransfer:
        raise InvalidRequestError("the stand-in engine has no KV memory to transfer")

    def attach_kv_store(self, store: KVStoreSettings, transfer: TransferSettings) -> None:
        raise InvalidRequestError("the stand-in engine has no KV memory for a store")

    def close(self) -> None:
        self.closed = True

    # -- internals -----------------------------------------------------------------------
    def _admit(self, request_id: str, prompt: list[int], params: SamplingParams, forks: Sequence[Fork]) -> None:
        params.validate()
        for rid in (request_id, *(f for f, _ in forks)):
            if rid in self._running or rid in self._held:
                raise InvalidRequestError(f"request id {rid!r} is already in use")
        vocab = self._description.vocab_size
        if not prompt or any(not 0 <= t < vocab for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        if len(prompt) >= self._description.max_model_len:
            raise InvalidRequestError(f"prompt has {len(prompt)} tokens but this model's context is "
                                      f"{self._description.max_model_len} tokens")

    def _next_token(self, request: _Request) -> int:
        last = request.output[-1] if request.output else request.prompt[-1]
        return (last + 1) % self._description.vocab_size

    def _advance(self, request: _Request, token: int) -> RequestOutput:
        request.output.append(token)
        self.counters.num_generated_tokens += 1
        reason = None
        if request.prefill_only:
            reason = FinishReason.PREFILL_DONE
            self._held[request.request_id] = request.num_blocks
        elif token in request.params.stop_token_ids:
            reason = FinishReason.STOP
        elif request.params.max_tokens is not None and len(request.output) >= request.params.max_tokens:
            reason = FinishReason.LENGTH
        elif len(request.prompt) + len(request.output) >= self._description.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            del self._running[request.request_id]
            self.counters.num_finished += 1
        return self._output(request, [token], reason)

    def _output(self, request: _Request, new_ids: list[int], reason: FinishReason | None) -> RequestOutput:
        return RequestOutput(request_id=request.request_id, new_token_ids=new_ids, finished=reason is not None,
                             finish_reason=reason, num_prompt_tokens=len(request.prompt), num_cached_tokens=0,
                             num_output_tokens=len(request.output))

    def _publish(self, events: list[KVEvent]) -> None:
        if events:
            for callback in self._subscribers:
                callback(events)
