"""vLLM behind the engine contract (services/engine_api/contract.py): `VllmEngine`.

vLLM runs in the worker's own process: one `vllm.v1.engine.llm_engine.LLMEngine` built with
`VLLM_ENABLE_V1_MULTIPROCESSING=0` (launcher.py), whose `step()` runs its scheduler and model
once, as the contract's `step()` does. Requests go in as token ids with vLLM's `SamplingParams`
(sampling.py; `RequestOutputKind.DELTA`, no detokenization) and come out as splitserve's
`RequestOutput`s. vLLM keys outputs by the caller's request id (it adds a random suffix
internally), and `abort_request` frees a request's blocks at once; vLLM emits nothing for an
aborted request, so the final ABORT output the contract promises is queued here and returned
by the next `step()`.

The description and load come from vLLM's own config and scheduler: its block pool (minus
the null block vLLM keeps), its running and waiting queues, and the cached-token counts its
outputs report. KV events: vLLM's ZMQ event stream translated to splitserve's block hashes
(kv_events.py) when one is attached; the hooks are those of the contract.

Disaggregated prefill/decode (issue 39) goes through splitserve's KV connector inside vLLM
(kv_connector.py, loaded when the worker's role is prefill or decode): the decode side's
reservation is a request vLLM holds blocks for while it waits for remote KV, the prefill side's
prefill-only request hands each layer to the sender as vLLM computes it, and the transfer
itself is splitserve's (kvtransfer over vLLM's KV buffer, `build_kv_transfer`). The two meet in
the process's `TransferBook` (transfer_book.py). With vLLM's own NixlConnector instead
(`--kv-connector nixl-vllm`, `kv_handoff`), the engine is a `KVHandoffEngine`: the prefill
side's request ends with vLLM's `kv_transfer_params`, which the decode side's request is given
(services/worker/kv/handoff.py); vLLM moves the KV.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from splitserve.checkpoints.fingerprint import Fingerprint
from splitserve.errors import InvalidRequestError, SplitserveError
from splitserve.kvtransfer.sender_receiver import LayerCallback
from splitserve.services.engine_api.contract import (EngineCounters, EngineDescription, EngineLoad, Fork,
                                                     KVStoreSettings, KVTransfer, RankGroup, Reservation,
                                                     TransferSettings)
from splitserve.services.engine_api.kv_events import KVEvent
from splitserve.services.engine_vllm.sampling import vllm_sampling_kwargs
from splitserve.services.engine_vllm.transfer_book import RECEIVE, SEND, TransferBook, transfer_params
from splitserve.services.worker_protocol.outputs import FinishReason, RequestOutput, SampledToken
from splitserve.services.worker_protocol.sampling_params import SamplingParams

log = logging.getLogger(__name__)

DISAGGREGATION_REFUSED = ("this vLLM worker runs without splitserve's KV connector (it serves --role both, or "
                          "--kv-connector nixl-vllm); run prefill and decode workers with --role prefill / "
                          "--role decode for disaggregated serving")
HANDOFF_POLL_S = 0.002      # between steps that only advance vLLM's NixlConnector (nothing to compute)
HANDOFF_REFUSED = ("this vLLM worker runs without vLLM's NixlConnector; run prefill and decode workers with "
                   "--kv-connector nixl-vllm on both sides")
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


@dataclass(slots=True)
class _Request:
    """What the contract's outputs need that vLLM's DELTA outputs do not repeat."""

    num_prompt_tokens: int
    params: SamplingParams
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs_sent: bool = False
    prefill_only: bool = False                           # a prefill worker's: ends PREFILL_DONE
    remote: bool = False                                 # a decode worker's: the prompt's KV came from a prefill worker
    awaiting_kv: bool = False                            # ... and has not arrived yet
    forks: Sequence[Fork] = ()                           # a reservation's other samples, added once it has
    fork_prompt: list[int] | None = None                 # ... and their prompt
    remote_prompt_logprobs: list[SampledToken] | None = None   # the prefill worker's, sent with the first output


def _torch() -> Any:
    import torch

    return torch


def client_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a request it refuses: its VLLMClientError family (validation) and the
    plain ValueError some of its checks still raise."""
    from vllm.exceptions import VLLMClientError

    return (VLLMClientError, ValueError)


def to_vllm_params(params: SamplingParams) -> Any:
    """vLLM's `SamplingParams` for `params`; vLLM's own validation errors become InvalidRequestError."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    kwargs = vllm_sampling_kwargs(params)
    structured = kwargs.pop("structured_outputs", None)
    bad_words = kwargs.pop("bad_words_token_ids", None)
    try:
        if structured is not None:
            kwargs["structured_outputs"] = StructuredOutputsParams(**structured)
        out = VllmSamplingParams(output_kind=RequestOutputKind.DELTA, **kwargs)
    except client_errors() as exc:
        raise InvalidRequestError(str(exc)) from None
    if bad_words:
        out._bad_words_token_ids = bad_words     # what update_from_tokenizer makes of bad words
    return out


def _fingerprint(model_config: Any) -> Fingerprint:
    """The worker's compatibility fingerprint (splitserve/checkpoints/fingerprint.py) of what vLLM
    loaded: a local folder's files, or the hub snapshot a model id resolved to."""
    import vllm

    from splitserve.checkpoints.fingerprint import (REVISION_ENV, default_cache_file, folder_tokenizer_digest,
                                                    named_revision, weights_digest)

    weights = _local_folder(model_config.model, model_config.revision)
    tokenizer = _local_folder(model_config.tokenizer, model_config.tokenizer_revision)
    weights_id = named_revision()
    if not weights_id and weights is not None:
        weights_id = weights_digest(weights, default_cache_file())
    elif not weights_id:
        weights_id = f"id:{model_config.model}@{model_config.revision or 'main'}"
        log.warning("the fingerprint of %s names its weights by id and revision: its files are not on this "
                    "machine's disk to digest (%s names them instead)", model_config.model, REVISION_ENV)
    return Fingerprint(weights_id,
                       folder_tokenizer_digest(tokenizer) if tokenizer is not None else f"id:{model_config.tokenizer}",
                       f"vllm/{vllm.__version__}")


def _local_folder(model: str, revision: str | None) -> Path | None:
    """`model` as a folder on disk: itself, or the hub cache's snapshot of it; None when neither."""
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:       # not in the cache (or not a hub id): named by id, not digested
        return None


class VllmEngine:
    """An `Engine` over one in-process vLLM `LLMEngine` (`llm`)."""

    def __init__(self, llm: Any, model_name: str, kv_events: Any = None, step_counts: Any = None,
                 transfers: TransferBook | None = None, kv_handoff: str = ""):
        self.llm = llm
        self._book = transfers                            # None: no splitserve KV connector in this vLLM
        self._handoff = kv_handoff                        # "nixl-vllm": vLLM's NixlConnector moves the KV
        self._num_threads = _torch().get_num_threads()    # what vLLM (and a pinned worker) set at load
        self._stepping_thread: int | None = None
        self._step_counts = step_counts                   # stat_counts.StepCounts: preemptions
        self._core = llm.engine_core.engine_core          # vLLM's EngineCore (InprocClient's)
        self._requests: dict[str, _Request] = {}
        self._pending: list[RequestOutput] = []           # ABORT outputs for the next step
        self._stats = EngineCounters()
        self._events = kv_events
        self._on_events: Callable[[list[KVEvent]], None] | None = None
        self._description = self._describe(model_name)

    def _describe(self, model_name: str) -> EngineDescription:
        cfg = self.llm.vllm_config
        mc, cc = cfg.model_config, cfg.cache_config
        dtype = str(mc.dtype).removeprefix("torch.")
        return EngineDescription(
            model_name=model_name, max_model_len=mc.max_model_len, vocab_size=mc.get_vocab_size(),
            block_size=cc.block_size, num_kv_blocks=self._pool.num_gpu_blocks - 1, dtype=dtype,
            device=str(cfg.device_config.device_type), tensor_parallel_size=cfg.parallel_config.tensor_parallel_size,
            block_hash_extra_key=f"{model_name}|torch.{dtype}|engine=vllm".encode(),
            max_logprobs=mc.max_logprobs, kv_handoff=self._handoff, fingerprint=_fingerprint(mc).text())

    @property
    def _pool(self) -> Any:
        return self._core.scheduler.kv_cache_manager.block_pool

    def describe(self) -> EngineDescription:
        return self._description

    def load(self) -> EngineLoad:
        sched, pool = self._core.scheduler, self._pool
        free = pool.free_block_queue.get_all_free_blocks()
        num_running, num_waiting = sched.get_request_counts()
        total = pool.num_gpu_blocks - 1                   # the null block is never free nor used
        t = self._book.counts() if self._book is not None else None
        receiving = t.num_waiting_receives if t else self._num_handoff_reads()
        return EngineLoad(
            num_kv_blocks=total, num_used_kv_blocks=total - len(free),
            num_cached_kv_blocks=sum(1 for b in free if b.block_hash is not None),
            num_running=num_running, num_waiting=num_waiting - receiving,
            num_remote_prefill=receiving,
            num_remote_prefill_kv_blocks=t.num_waiting_receive_blocks if t else 0,
            num_held_prefills=t.num_held_sends if t else self._num_handoff_sends(),
            num_fenced_kv_blocks=t.num_held_receive_blocks if t else 0,
            counters=self._counters())

    def _counters(self) -> EngineCounters:
        counters = replace(self._stats, num_preemptions=self._step_counts.preemptions if self._step_counts else 0)
        if self._handoff and self._step_counts is not None:
            # A handed-off request's output reports the prefill worker's cache hits (vLLM's usage
            # rule), not what this vLLM computed: its step stats say that.
            sources = self._step_counts.prompt_sources
            counters = replace(counters, num_prompt_tokens_computed=sources.computed,
                               num_prefix_hit_tokens=sources.local_cache_hit + sources.external_kv_transfer,
                               num_computed_tokens=sources.computed + counters.num_generated_tokens)
        return counters

    @property
    def ranks(self) -> RankGroup | None:
        return None             # vLLM's tensor-parallel workers live and fail inside it

    # -- requests ----------------------------------------------------------------
    def prepare(self, params: SamplingParams) -> None:
        to_vllm_params(params)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    forks: Sequence[Fork] = (), prefill_only: bool = False,
                    on_layer_done: LayerCallback | None = None) -> None:
        if prefill_only:
            self._add_prefill_only(request_id, prompt_token_ids, params, on_layer_done)
            return
        # Every fork is a request of its own: vLLM's prefix cache shares the prompt's full blocks.
        batch = [(request_id, params), *forks]
        vllm_params = [(rid, p, self._checked(rid, prompt_token_ids, p)) for rid, p in batch]
        for rid, p, vp in vllm_params:
            try:
                self._add_to_vllm(rid, prompt_token_ids, p, vp)
            except InvalidRequestError:        # vLLM's validation (prompt length, logprobs limits...)
                for added, _, _ in vllm_params:
                    if added == rid:
                        break
                    self.abort(added)
                raise
            self._requests[rid] = _Request(len(prompt_token_ids), p)
        self._stats.num_forks += len(forks)

    def _add_prefill_only(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          on_layer_done: LayerCallback | None) -> None:
        """A prefill worker's request: the prompt and one sampled token, each layer's KV handed to
        the sender as vLLM computes it, the blocks held until `release_transfer`."""
        book = self._require_transfers()
        if on_layer_done is None:
            raise InvalidRequestError("a prefill-only request needs the sender's layer callback")
        vp = self._checked(request_id, prompt_token_ids, replace(params, max_tokens=1, min_tokens=0))
        vp.extra_args = {**(vp.extra_args or {}), "kv_transfer_params": transfer_params(SEND, request_id)}
        book.expect_send(request_id, on_layer_done)
        try:
            self._add_to_vllm(request_id, prompt_token_ids, params, vp)
        except BaseException:
            book.forget(SEND, request_id)
            raise
        self._requests[request_id] = _Request(len(prompt_token_ids), params, prefill_only=True)

    def _add_to_vllm(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, vp: Any) -> None:
        prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_token_ids)}
        if params.cache_salt:
            prompt["cache_salt"] = params.cache_salt
        try:
            self.llm.add_request(request_id, prompt, vp)
        except client_errors() as exc:
            raise InvalidRequestError(str(exc)) from None

    def _require_transfers(self) -> TransferBook:
        if self._book is None:
            raise InvalidRequestError(DISAGGREGATION_REFUSED)
        return self._book

    def _checked(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Any:
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        d = self._description
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty")
        if any(not isinstance(t, int) or not 0 <= t < d.vocab_size for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {d.vocab_size})")
        if len(prompt_token_ids) >= d.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {d.max_model_len} tokens. However, your request has "
                f"{len(prompt_token_ids)} input tokens (at least one more is generated) "
                f"(parameter=input_tokens, value={len(prompt_token_ids)})")
        params.check_vocab(d.vocab_size)
        params.check_logprobs(d.max_logprobs, d.vocab_size)
        return to_vllm_params(params)

    def abort(self, request_id: str) -> bool:
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        self.llm.abort_request([request_id])      # a transfer's blocks stay held (kv_connector.py)
        self._stats.num_aborted += 1
        self._pending.append(RequestOutput(request_id, [], True, FinishReason.ABORT, state.num_prompt_tokens,
                                           state.num_cached_tokens, state.num_output_tokens))
        return True

    def has_unfinished(self) -> bool:
        if self._pending or (self._book is not None and self._book.has_finished()) or self._handoff_pending():
            return True
        if not self.llm.has_unfinished_requests():
            return False
        # Requests waiting for a prefill worker's KV are vLLM's too, but no step advances them:
        # stepping for them alone would spin a core the prefill worker may need.
        awaiting = sum(1 for state in self._requests.values() if state.awaiting_kv)
        return not awaiting or sum(self._core.scheduler.get_request_counts()) > awaiting

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        outputs.extend(self._run_step())
        self._publish_events()
        return outputs

    def _run_step(self) -> list[RequestOutput]:
        if not (self.llm.has_unfinished_requests() or (self._book is not None and self._book.has_finished())):
            if not self._handoff_pending():
                return []
        if self._handoff and self._only_connector_work():
            time.sleep(HANDOFF_POLL_S)     # nothing to compute, only NIXL to hear from: no busy core
        self._align_threads()
        self._stats.num_steps += 1
        return [self._convert(out) for out in self.llm.step() if out.request_id in self._requests]

    def _handoff_pending(self) -> bool:
        """vLLM's NixlConnector keeps a finished prefill's blocks until the decode worker has read
        them (or the lease ran out), and a read the decode side started completes: only steps
        (its get_finished) see either."""
        return bool(self._handoff) and self._core.scheduler.has_requests()

    def _num_handoff_reads(self) -> int:
        """Requests whose KV vLLM's NixlConnector is reading (decode side of a handoff)."""
        if not self._handoff:
            return 0
        from vllm.v1.request import RequestStatus

        return sum(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in self._waiting_requests())

    def _num_handoff_sends(self) -> int:
        """Finished requests whose blocks vLLM's NixlConnector keeps until a decode worker read
        them (prefill side of a handoff: the scheduler frees them on `finished_sending`)."""
        if not self._handoff:
            return 0
        return sum(r.is_finished() for r in list(self._core.scheduler.requests.values()))

    def _waiting_requests(self) -> tuple:
        """vLLM's waiting requests, those waiting for remote KV included."""
        sched = self._core.scheduler
        return (*sched.waiting, *getattr(sched, "kv_holding_waiting", ()))

    def _only_connector_work(self) -> bool:
        """No request to compute: every one waits for a NIXL read (decode side) or holds its blocks
        for one (prefill side, finished)."""
        from vllm.v1.request import RequestStatus

        if self._core.scheduler.running:
            return False
        return all(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in self._waiting_requests())

    def _align_threads(self) -> None:
        """torch's thread count is the process's, OpenMP's is per thread, and vLLM was loaded on
        another thread than the one that steps it (the worker's engine thread): without this, vLLM's
        CPU attention plans a long prefill for the stepping thread's OpenMP count and runs it with
        torch's, and its check fails the step ("thread_num == thread_num (2 vs. 1)")."""
        me = threading.get_ident()
        if me != self._stepping_thread:
            _torch()._C.set_num_threads(self._num_threads)    # vLLM's CPU worker makes torch.set_num_threads a no-op
            self._stepping_thread = me

    def _convert(self, out: Any) -> RequestOutput:
        state = self._requests[out.request_id]
        completion = out.outputs[0]
        new_ids = list(completion.token_ids)
        first = state.num_output_tokens == 0 and new_ids
        if first and state.remote:
            self._stats.num_prefix_hit_tokens += state.num_cached_tokens    # vLLM counts the received KV too
        elif first:
            state.num_cached_tokens = out.num_cached_tokens or 0
            s = self._stats
            s.num_prefix_hit_tokens += state.num_cached_tokens
            s.num_prompt_tokens_computed += state.num_prompt_tokens - state.num_cached_tokens
            s.num_computed_tokens += state.num_prompt_tokens - state.num_cached_tokens
        if first and state.forks:       # a handed-off prompt's other samples: its KV is in the cache now
            for rid, p in state.forks:
                self.add_request(rid, state.fork_prompt, p)
            state.forks, state.fork_prompt = (), None
        state.num_output_tokens += len(new_ids)
        self._stats.num_generated_tokens += len(new_ids)
        self._stats.num_computed_tokens += len(new_ids)
        reason = _FINISH.get(completion.finish_reason) if out.finished else None
        if out.finished:
            self._requests.pop(out.request_id, None)
            self._stats.num_finished += 1
            reason = FinishReason.PREFILL_DONE if state.prefill_only else reason or FinishReason.STOP
        result = RequestOutput(out.request_id, new_ids, out.finished, reason, state.num_prompt_tokens,
                               state.num_cached_tokens, state.num_output_tokens)
        if out.finished and state.prefill_only and self._handoff:
            result.kv_handoff = dict(out.kv_transfer_params or {}) or None
        if first and state.remote_prompt_logprobs is not None:
            result.prompt_logprobs, state.prompt_logprobs_sent = state.remote_prompt_logprobs, True
        if state.params.logprobs is not None and completion.logprobs:
            result.logprobs = [sampled_token(t, lps, state.params) for t, lps in zip(new_ids, completion.logprobs)]
        if state.params.prompt_logprobs is not None and not state.prompt_logprobs_sent and out.prompt_logprobs:
            state.prompt_logprobs_sent = True
            result.prompt_logprobs = prompt_tokens(out.prompt_token_ids, out.prompt_logprobs,
                                                   state.params.prompt_logprobs)
        return result

    # -- disaggregated prefill through vLLM's NixlConnector (KVHandoffEngine) -----------
    def add_handoff_prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Prefill side: the prompt and one token; vLLM's connector keeps the blocks for the decode
        worker to read (on its lease) and the PREFILL_DONE output carries its kv_transfer_params."""
        self._require_handoff()
        vp = self._checked(request_id, prompt_token_ids, replace(params, max_tokens=1, min_tokens=0))
        vp.extra_args = {**(vp.extra_args or {}), "kv_transfer_params": {"do_remote_decode": True}}
        self._add_to_vllm(request_id, prompt_token_ids, params, vp)
        self._requests[request_id] = _Request(len(prompt_token_ids), params, prefill_only=True)

    def add_handed_off(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       kv_handoff: dict, *, forks: Sequence[Fork] = (),
                       prompt_logprobs: list[SampledToken] | None = None) -> None:
        """Decode side: vLLM reads the prompt's KV as `kv_handoff` says, recomputes the last prompt
        token and samples the first; forks are added once it has (they share its cached prompt)."""
        self._require_handoff()
        for rid, p in forks:
            self._checked(rid, prompt_token_ids, p)
        vp = self._checked(request_id, prompt_token_ids, params)
        vp.prompt_logprobs = None       # the prefill worker's come with the first output
        vp.extra_args = {**(vp.extra_args or {}), "kv_transfer_params": dict(kv_handoff)}
        self._add_to_vllm(request_id, prompt_token_ids, params, vp)
        self._requests[request_id] = _Request(len(prompt_token_ids), params, forks=tuple(forks),
                                              fork_prompt=list(prompt_token_ids) if forks else None,
                                              remote_prompt_logprobs=prompt_logprobs)

    def _require_handoff(self) -> None:
        if not self._handoff:
            raise InvalidRequestError(HANDOFF_REFUSED)

    # -- disaggregated prefill: the decode side (kv_connector.py) ------------------------
    def num_cached_prompt_tokens(self, token_ids: list[int], cache_salt: str = "") -> int:
        return 0        # counted by vLLM at the reservation: the Prefill call then skips those blocks

    def reserve_remote_prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                               fence_writes: bool = False, forks: Sequence[Fork] = ()) -> Reservation | None:
        """vLLM allocates a remote prompt's blocks when it first schedules the request, so the
        request is added and one step run now (other requests' outputs of that step wait for the
        next `step()`); None, with the request withdrawn, when vLLM could not admit it."""
        book = self._require_transfers()
        for rid, p in [(request_id, params), *forks]:
            vp = self._checked(rid, prompt_token_ids, p)
            if rid == request_id:
                primary = vp
        block_size = self._description.block_size
        if -(-len(prompt_token_ids) // block_size) > len(self._pool.free_block_queue.get_all_free_blocks()):
            return None
        primary.prompt_logprobs = None      # the prefill worker's come with the first output
        primary.extra_args = {**(primary.extra_args or {}), "kv_transfer_params": transfer_params(RECEIVE, request_id)}
        transfer = book.expect_receive(request_id)
        try:
            self._add_to_vllm(request_id, prompt_token_ids, params, primary)
        except BaseException:
            book.forget(RECEIVE, request_id)
            raise
        state = self._requests[request_id] = _Request(len(prompt_token_ids), params, remote=True, awaiting_kv=True,
                                                      forks=tuple(forks),
                                                      fork_prompt=list(prompt_token_ids) if forks else None)
        self._pending.extend(self._run_step())
        if transfer.block_ids is None:
            self._requests.pop(request_id, None)
            self.llm.abort_request([request_id])
            book.forget(RECEIVE, request_id)
            return None
        state.num_cached_tokens = transfer.num_local_tokens
        return Reservation(list(transfer.block_ids), transfer.num_local_tokens)

    def complete_remote_prefill(self, request_id: str, first_token: int | SampledToken,
                                prompt_logprobs: list[SampledToken] | None = None) -> RequestOutput | None:
        """The KV is in place: vLLM's next step recomputes the prompt's last token and samples
        the first token (vLLM's rule for remote KV; `first_token`, the prefill worker's draw, is
        not used). The output returned carries no token."""
        state = self._requests.get(request_id)
        if state is None or not state.awaiting_kv or not self._require_transfers().mark_received(request_id):
            return None
        state.awaiting_kv, state.remote_prompt_logprobs = False, prompt_logprobs
        for rid, p in state.forks:       # each fork takes the received prompt from vLLM's prefix cache
            self.add_request(rid, state.fork_prompt, p)
        state.forks, state.fork_prompt = (), None
        return RequestOutput(request_id, [], False, None, state.num_prompt_tokens, state.num_cached_tokens, 0)

    def cancel_remote_prefill(self, request_id: str) -> bool:
        state = self._requests.get(request_id)
        if state is None or not state.awaiting_kv:
            return False
        del self._requests[request_id]
        self.llm.abort_request([request_id])     # its blocks stay held until release_transfer
        return True

    def release_transfer(self, request_id: str) -> bool:
        return self._book is not None and self._book.release(request_id)

    # -- KV events ---------------------------------------------------------------
    def attach_kv_events(self, events: Any) -> None:
        """Republish `events` (a kv_events.VllmKVEvents on this vLLM's stream); before the worker
        installs its hooks."""
        self._events = events

    def subscribe_events(self, callback: Callable[[list[KVEvent]], None]) -> None:
        self._on_events = callback

    def wake_on_store_events(self, wake: Callable[[], None]) -> None:
        if self._events is not None:
            self._events.start(wake)

    def flush_store_events(self) -> None:
        self._publish_events()

    def _publish_events(self) -> None:
        if self._events is None or self._on_events is None:
            return
        events = self._events.take_events()
        if events:
            self._on_events(events)

    # -- wiring ------------------------------------------------------------------
    def build_kv_transfer(self, settings: TransferSettings) -> KVTransfer:
        """kvtransfer's connector over vLLM's KV buffer (registered by kv_connector.py), vLLM's
        paged layout."""
        from splitserve.kvtransfer.backends import make_connector, resolve_backend
        from splitserve.kvtransfer.layout import PAGED_LAYOUT, KVLayout, dtype_name
        from splitserve.kvtransfer.rank_transfer import SingleRankTransfer
        from splitserve.services.engine_vllm.kv_connector import registered_pool

        self._require_transfers()
        pool = registered_pool()
        if pool is None:
            raise SplitserveError("vLLM registered no KV cache with splitserve's KV connector")
        d = self._description
        num_layers, _, num_kv_heads, _, block_size, head_dim = pool.tensor.shape
        layout = KVLayout(model=d.block_hash_extra_key.decode(), dtype=dtype_name(pool.tensor.dtype),
                          num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          block_size=block_size, layout=PAGED_LAYOUT, fingerprint=d.fingerprint)
        backend = resolve_backend(settings.backend)
        kwargs = {"token": settings.token}
        if backend == "tcp":
            kwargs.update(host=settings.host, advertise_host=settings.advertise_host)
        connector = make_connector(backend, settings.name, layout, **kwargs)
        try:
            connector.register(pool.tensor)
        except BaseException:
            connector.close()
            raise
        return SingleRankTransfer(connector, block_size)

    def attach_kv_store(self, store: KVStoreSettings, transfer: TransferSettings) -> None:
        raise SplitserveError("the shared KV store (--kv-store) is not available with the vLLM engine")

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
        try:
            self.llm.engine_core.shutdown()
        except Exception:               # best effort at exit
            log.exception("vLLM engine shutdown failed")


def sampled_token(token_id: int, logprobs: dict[int, Any], params: SamplingParams) -> SampledToken:
    """One generated token from vLLM's logprobs entry ({token id: Logprob}: the sampled token and
    the top-n, or the sampled token and `logprob_token_ids`)."""
    chosen = logprobs.get(token_id)
    if params.logprob_token_ids:
        top = {t: logprobs[t].logprob for t in params.logprob_token_ids if t in logprobs}
    else:
        n = params.logprobs or 0
        top = {t: lp.logprob for t, lp in logprobs.items() if lp.rank is not None and lp.rank <= n}
    return SampledToken(token_id, chosen.logprob if chosen is not None else None, top,
                        chosen.rank if chosen is not None else None)


def prompt_tokens(prompt_ids: list[int], prompt_logprobs: list[dict[int, Any] | None], n: int) -> list[SampledToken]:
    """vLLM's prompt logprobs (None for the first token, then {token id: Logprob}) in splitserve's shape:
    one entry per prompt token from the second on."""
    out = []
    for token_id, entry in zip(prompt_ids[1:], prompt_logprobs[1:]):
        entry = entry or {}
        chosen = entry.get(token_id)
        top = {t: lp.logprob for t, lp in entry.items() if lp.rank is not None and lp.rank <= n}
        out.append(SampledToken(token_id, chosen.logprob if chosen is not None else None, top,
                                chosen.rank if chosen is not None else None))
    return out
