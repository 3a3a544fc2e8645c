"""LLMEngine: the synchronous, step-driven core of a worker.

`add_request` queues work, `step` runs one scheduler decision through the model
and returns what each request produced, `abort` drops a request and its blocks.
The disaggregated path adds two modes (DESIGN section 2): a prefill-only request
calls back after each layer with the blocks it wrote (so a connector can push
them while the next layer computes), and a decode worker reserves blocks for a
prompt that another worker fills, then joins it to the batch with its first token.
Outputs are token ids: a request stops on token ids, max_tokens or the context
limit (`token_stop_reason`); text and stop strings are the frontend's (services/text/).

A request may carry `forks`: sibling samples of the same prompt (n > 1, best_of), each
an ordinary request id of its own. The prompt is prefilled once; when that prefill
completes the siblings take its KV blocks (scheduler.fork: full blocks by reference, the
partial last one copied) and every sample draws its first token from the same last-position
logits with its own generator.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

import splitserve
from splitserve.checkpoints.fingerprint import checkpoint_fingerprint
from splitserve.errors import InvalidRequestError

from splitserve.services.engine.block_pool import BlockPool
from splitserve.services.engine.grammar import StructuredOutputs
from splitserve.services.engine.config import EngineConfig, ModelConfig
from splitserve.services.engine.cpu_placement import apply_rank_threads
from splitserve.services.engine.model.forward_batch import LayerReport
from splitserve.services.engine.kv_cache import KVCache
from splitserve.services.engine_api.contract import EngineCounters, Reservation
from splitserve.services.engine_api.kv_events import KVEvent
from splitserve.kvtransfer.block_codec import layout_key
from splitserve.services.engine.kv_tiers.shared_store import SharedStore
from splitserve.services.engine.kv_tiers.tiers import KVTiers, TierConfig
from splitserve.services.engine.model_runner import ModelRunner, prompt_logit_positions
from splitserve.services.engine.loading.smollm2 import open_model
from splitserve.services.engine.logits_controls import TokenCounts, TokenHistory
from splitserve.services.engine.prompt_logprobs import score_prompt_tokens
from splitserve.services.engine.sampler import SampledToken, sample, skip_draws
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.services.engine.scheduler import ScheduledChunk, Scheduler
from splitserve.kvtransfer.sender_receiver import LayerCallback, LayerReady
from splitserve.services.engine.sequence import (FinishReason, Sequence,
                                                 SequenceStatus, TransferUse)
from splitserve.services.engine.parallel.tensor_parallel import TensorParallelGroup
from splitserve.services.engine.rank import build_rank
from splitserve.services.text.tokenizer import Tokenizer
from splitserve.services.worker_protocol.outputs import RequestOutput
from splitserve.services.engine.loading.weights import ShardSpec

log = logging.getLogger(__name__)


@dataclass(slots=True)
class GenerationResult:
    """One prompt run to completion: token ids only (text: services/text/generate.py)."""

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[SampledToken] = field(default_factory=list)
    prompt_logprobs: list[SampledToken] | None = None     # params.prompt_logprobs: tokens 1.. of the prompt


@dataclass(slots=True, frozen=True)
class SuspendedKV:
    """A suspended request's KV (`LLMEngine.suspend`): the tokens it covers, the blocks holding it."""

    token_ids: list[int]
    block_ids: list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self._core_sharing = apply_rank_threads(config, 0)
        if config.block_size < 1 or config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
            raise InvalidRequestError("block_size, max_num_batched_tokens and max_num_seqs must be >= 1")
        ckpt = open_model(config.model)
        self.model_config = ModelConfig.from_hf(ckpt.config, ckpt.generation_config)
        self.tokenizer = Tokenizer(ckpt)
        # What a worker that exchanges KV with this one must equal (kvtransfer/layout.py).
        self.fingerprint = checkpoint_fingerprint(ckpt.source or config.model, ckpt.tokenizer_json,
                                                  ckpt.tokenizer_config, f"builtin/{splitserve.__version__}",
                                                  config.weights_revision)
        mc = self.model_config
        num_blocks = config.num_kv_blocks or self._blocks_for_memory(config, mc)
        self.config = replace(config, num_kv_blocks=num_blocks, model=ckpt.source or config.model,
                              model_name=config.model_name or ckpt.name)
        ShardSpec(0, config.tensor_parallel_size).check(mc)   # before any rank starts
        self.tp = TensorParallelGroup(self.config) if config.tensor_parallel_size > 1 else None
        try:
            model, kv = build_rank(self.config, 0, ckpt)
            if self.tp is not None:
                self.tp.wait_ready()      # every rank loaded its shard: the group can step
        except BaseException:
            self.close()
            raise
        self.runner = ModelRunner(model, kv, torch.device(config.device),
                                  broadcast=self.tp.broadcast if self.tp else None)
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
        extra_key = f"{self.config.model_name}|{self.config.torch_dtype()}|{config.extra_cache_key}"
        self._extra_key = extra_key
        self.tiers = self._make_tiers(kv, extra_key)
        if self.tiers is not None:
            self.pool.on_evict = self.tiers.write_down
        self.scheduler = Scheduler(self.pool, config.max_num_batched_tokens, config.max_num_seqs,
                                   extra_key.encode(), self.tiers)
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings, num_blocks * config.block_size)
        self.eos_token_ids = set(mc.eos_token_ids) | self.tokenizer.eos_token_ids
        self.structured_outputs = StructuredOutputs(self.tokenizer, mc.vocab_size, self.eos_token_ids)
        self.stats = EngineCounters()
        self._rng = random.Random(config.seed)
        self._arrivals = 0
        self._pending_outputs: list[RequestOutput] = []
        self._event_subscribers: list[Callable[[list[KVEvent]], None]] = []
        self.suspended: dict[str, SuspendedKV] = {}     # live migration: requests whose KV waits to be read

    def _make_tiers(self, kv: KVCache, extra_key: str, store: bool = False) -> KVTiers | None:
        c = self.config
        tiers = TierConfig(c.kv_host_gib, c.kv_disk_gib, c.kv_disk_path)
        if c.kv_host_gib < 0 or c.kv_disk_gib < 0:
            raise InvalidRequestError("--kv-host-gib and --kv-disk-gib must be >= 0")
        if c.kv_disk_gib > 0 and not c.kv_disk_path:
            raise InvalidRequestError("--kv-disk-gib needs --kv-disk-path (a folder for the block files)")
        if not (tiers.enabled or store):
            return None
        if c.tensor_parallel_size > 1:
            raise InvalidRequestError("KV tiers (--kv-host-gib, --kv-disk-gib, --kv-store) need --tp 1 for now: "
                                      "each rank would have to write down and load its own shard")
        if not c.enable_prefix_caching:
            raise InvalidRequestError("KV tiers hold prefix-cache blocks: they need prefix caching on")
        shape = tuple(kv.tensor.shape)
        layout = layout_key(f"{extra_key}|{shape[0]}x{shape[3]}x{shape[4]}x{shape[5]}|tp0/1"
                            f"|{self.fingerprint.text()}")      # another revision's blocks are refused
        return KVTiers(kv, layout, tiers, self.pool.events)

    def attach_store(self, store: SharedStore) -> None:
        """Use a shared block store (kv_tiers/shared_store.py) below this engine's tiers: fetch the
        prefixes it holds, publish the blocks computed here. Engine thread, or before serving."""
        if self.tiers is None:
            tiers = self._make_tiers(self.runner.kv, self._extra_key, store=True)
            self.pool.on_evict, self.tiers, self.scheduler.tiers = tiers.write_down, tiers, tiers
        self.tiers.attach_store(store)
        self.pool.on_cached = self.tiers.note_cached

    @staticmethod
    def _blocks_for_memory(config: EngineConfig, mc: ModelConfig) -> int:
        per_block = KVCache.bytes_per_block(mc.num_layers, config.block_size,
                                            mc.num_kv_heads // config.tensor_parallel_size,
                                            mc.head_dim, config.torch_dtype())
        return max(1, int(config.kv_cache_gib * 2**30) // per_block)

    # -- requests ----------------------------------------------------------------
    def add_request(self, request_id: str, prompt: list[int] | str, params: SamplingParams,
                    *, prefill_only: bool = False, on_layer_done: LayerCallback | None = None,
                    forks: list[tuple[str, SamplingParams]] = ()) -> None:
        """Queue a request; `forks` are (request id, params) of more samples of the same prompt,
        which share its prefill (each is then a request of its own: outputs, abort)."""
        if forks and prefill_only:
            raise InvalidRequestError("a prefill-only request cannot fork")
        ids = [request_id, *(rid for rid, _ in forks)]
        if len(set(ids)) != len(ids):
            raise InvalidRequestError("forked request ids must be distinct")
        seq = self._new_sequence(request_id, prompt, params, prefill_only, on_layer_done)
        seq.forks = [self._new_sequence(rid, seq.prompt_token_ids, p, False, None) for rid, p in forks]
        if prefill_only:
            seq.transfer = TransferUse.SEND     # its blocks stay for the sender: release_transfer
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request now; its blocks are free before the next step. False if unknown.

        A finished prefill-only request's blocks are released too (this worker's own sender
        reads them, and the abort ends its send); a given-up reservation's granted blocks
        are not: only the write fence knows when no write can land (`release_transfer`).
        """
        seq = self.scheduler.find(request_id)
        if seq is None:
            found = self.scheduler.find_fork(request_id)
            if found is not None:
                parent, seq = found
                parent.forks.remove(seq)
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = FinishReason.ABORT
                self.stats.num_aborted += 1
                self._pending_outputs.append(self._output(seq, [], []))
                return True
            hold = self.scheduler.transfer_owned.get(request_id)
            if hold is None or hold.use is not TransferUse.SEND:
                return False
            return self.scheduler.transfer_done(request_id)
        if seq.forks:
            # The siblings still wait for this prefill: the first of them takes it over.
            heir, *rest = seq.forks
            seq.forks, heir.forks = [], rest
            self.scheduler.add(heir)
        self.scheduler.finish(seq, FinishReason.ABORT)
        self.stats.num_aborted += 1
        self._pending_outputs.append(self._output(seq, [], []))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self.scheduler.remote)

    # -- disaggregated decode side ----------------------------------------------
    def reserve_remote_prefill(self, request_id: str, prompt: list[int], params: SamplingParams,
                               fence_writes: bool = False, forks: list[tuple[str, SamplingParams]] = ()
                               ) -> Reservation | None:
        """Hold KV blocks for a prompt another worker will fill; None when the pool is full.
        `forks`: more samples (as add_request's), forked from these blocks once they are filled.

        `fence_writes`: when the reservation is cancelled or aborted, the blocks granted to
        the writer stay out of the pool until `release_transfer(request_id)` (the caller
        knows when no write can land any more)."""
        seq = self._new_sequence(request_id, prompt, params, False, None)
        seq.forks = [self._new_sequence(rid, seq.prompt_token_ids, p, False, None) for rid, p in forks]
        if fence_writes:
            seq.transfer = TransferUse.RECEIVE
        if seq.generator is not None and params.seed is not None:
            # The prefill worker samples the first token with the draw after the prior ones.
            skip_draws(seq.generator, 1, self.model_config.vocab_size)
        return self.scheduler.reserve_remote(seq)

    def complete_remote_prefill(self, request_id: str, first_token: int | SampledToken,
                                prompt_logprobs: list[SampledToken] | None = None) -> RequestOutput | None:
        """The reserved blocks now hold the prompt's KV: decode continues from `first_token`
        (a token id, or the prefill side's SampledToken to keep its logprobs); `prompt_logprobs`
        are the prefill side's, sent on with the first token."""
        seq = self.scheduler.complete_remote(request_id)
        if seq is None:
            return None
        if prompt_logprobs is not None:
            seq.prompt_logprobs = list(prompt_logprobs)
        self.scheduler.cache_computed_blocks(seq)
        if seq.forks:
            # The prefill worker sent KV and this request's first token, not the logits: the
            # siblings recompute the last prompt token (into their own copy of its block).
            siblings, seq.forks = seq.forks, []
            for sibling in siblings:
                sibling.prompt_logprobs = list(seq.prompt_logprobs)
            self.scheduler.fork(seq, siblings, len(seq.prompt_token_ids) - 1)
            self._count_forks()
        token = first_token if isinstance(first_token, SampledToken) else SampledToken(first_token)
        output = self._append_token(seq, token)
        self._publish_events()
        return output

    def cancel_remote_prefill(self, request_id: str) -> bool:
        """Give back a reservation without producing any output (e.g. to prefill locally instead)."""
        seq = self.scheduler.remote.get(request_id)
        if seq is None:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT)
        return True

    # -- live migration (issue 41): a running request's KV moves to another decode worker --
    def suspend(self, request_id: str) -> int | None:
        """Stop decoding a running request and keep its KV blocks for another worker to read
        (`export_suspended`) until `release_suspended`; its stream ends (ABORT). Returns how many
        tokens' KV the blocks hold (prompt + output but the last token, sampled and not computed
        yet); None when it cannot be suspended: unknown, not decoding yet, the prompt of samples
        not yet forked, tensor parallel (each rank would send its own share)."""
        seq = self.scheduler.find(request_id)
        if (seq is None or seq.status is not SequenceStatus.RUNNING or seq.forks or seq.prefill_only
                or seq.transfer is not None or self.tp is not None or not seq.output_token_ids
                or seq.num_computed_tokens != seq.num_tokens - 1):
            return None
        held = SuspendedKV(seq.all_token_ids[:seq.num_computed_tokens], list(seq.block_ids))
        self.pool.take_refs(held.block_ids)           # kept past the finish below
        self.suspended[request_id] = held
        self.scheduler.finish(seq, FinishReason.ABORT)
        self._pending_outputs.append(self._output(seq, [], []))
        return len(held.token_ids)

    def export_suspended(self, request_id: str, transfer_id: str, token_ids: list[int],
                         on_layer_done: LayerCallback) -> int:
        """Report every layer of the blocks holding the first len(token_ids) - 1 tokens' KV of the
        suspended `request_id` to `on_layer_done` (a sender, under `transfer_id`); returns that
        number of tokens. Raises InvalidRequestError when nothing is held or the tokens differ."""
        held = self.suspended.get(request_id)
        if held is None:
            raise InvalidRequestError(f"no suspended request {request_id!r} here (it ended, or its hold expired)")
        n = len(token_ids) - 1
        if n < 1 or n > len(held.token_ids) or token_ids[:n] != held.token_ids[:n]:
            raise InvalidRequestError(f"the suspended request {request_id!r} holds the KV of other tokens")
        blocks = held.block_ids[:-(-n // self.config.block_size)]
        for layer in range(self.model_config.num_layers):
            on_layer_done(LayerReady(transfer_id, layer, 0, blocks, n))
        return n

    def release_suspended(self, request_id: str) -> bool:
        """The suspended request's KV was read (or its hold expired): free its blocks."""
        held = self.suspended.pop(request_id, None)
        if held is not None:
            self.pool.release(held.block_ids)
        return held is not None

    def reserve_migration(self, request_id: str, token_ids: list[int], params: SamplingParams
                          ) -> Reservation | None:
        """A migrated request's blocks (`token_ids`: prompt + output so far), for the KV of all but
        the last token, which this worker computes (`complete_migration`) and samples after, as
        with a local prefill: no prefix-cache hit covers it, and no draw is skipped for it. The
        reservation is fenced as `reserve_remote_prefill(fence_writes=True)`'s."""
        seq = self._new_sequence(request_id, token_ids, params, False, None)
        seq.transfer = TransferUse.RECEIVE
        return self.scheduler.reserve_remote(seq, allow_full=False)

    def complete_migration(self, request_id: str) -> RequestOutput | None:
        """The reserved blocks hold the KV of all but the last token: compute that one next step."""
        seq = self.scheduler.remote.get(request_id)
        if seq is None:
            return None
        self.scheduler.complete_remote(request_id, num_computed_tokens=len(seq.prompt_token_ids) - 1)
        self.scheduler.cache_computed_blocks(seq)
        self._publish_events()
        return self._output(seq, [], [])

    # -- blocks a transfer still uses (both sides) ---------------------------------
    def release_transfer(self, request_id: str) -> bool:
        """The transfer is done with `request_id`'s blocks: free them. False if it held none.

        Prefill side: a prefill-only request finishes with its blocks held (a connector
        reads them to send); release them once the send is over (or with `abort`).
        Decode side: a fenced reservation given up leaves its granted blocks held; release
        them once no write into them can land any more."""
        return self.scheduler.transfer_done(request_id)

    @property
    def num_held_requests(self) -> int:
        """Finished prefill-only requests whose blocks a connector may still be reading."""
        return sum(h.use is TransferUse.SEND for h in self.scheduler.transfer_owned.values())

    @property
    def num_fenced_blocks(self) -> int:
        """Granted blocks of given-up reservations that a prefill worker may still write."""
        return sum(len(h.block_ids) for h in self.scheduler.transfer_owned.values()
                   if h.use is TransferUse.RECEIVE)

    # -- one step ----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        decision = self.scheduler.schedule()
        if not decision.chunks:
            return outputs
        if self._core_sharing is not None:
            self._core_sharing.before_step()
        reports = self._layer_reports(decision.chunks)
        scored = [(c.seq, prompt_logit_positions(c)) for c in decision.chunks]   # before advance
        started, prompt_before = time.perf_counter(), self.stats.num_prompt_tokens_computed
        try:
            logits = self.runner.execute(decision.chunks, self._layer_callback(decision.chunks, reports),
                                         reports, decision.block_copies).cpu()
        finally:
            self.scheduler.copies_done(decision.block_copies)
        self._count(decision.chunks, len(decision.preempted))
        sampled = [c.seq for c in decision.chunks if c.completes]
        for chunk in decision.chunks:
            self.scheduler.advance(chunk)
        if len(logits) > len(sampled):
            score_prompt_tokens(logits[len(sampled):], [(s, r) for s, r in scored if r])
            logits = logits[:len(sampled)]
        sampled, rows = self._fork_prefilled(sampled)
        if len(rows) != logits.shape[0]:
            logits = logits.index_select(0, torch.tensor(rows, dtype=torch.long))
        vocab = self.model_config.vocab_size
        tokens = sample(logits, [s.params for s in sampled], [s.generator for s in sampled],
                        [_history(s, vocab) for s in sampled], self.eos_token_ids,
                        [s.grammar for s in sampled])
        outputs.extend(self._append_token(s, t) for s, t in zip(sampled, tokens))
        if self.tiers is not None:
            self.tiers.after_step(self.stats.num_prompt_tokens_computed - prompt_before,
                                  time.perf_counter() - started)
        self._publish_events()
        return outputs

    def _fork_prefilled(self, sampled: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """Fork the siblings of each sequence whose prompt just completed; returns every
        sequence that samples now and the logits row each samples from (siblings share
        their parent's row)."""
        seqs, rows = list(sampled), list(range(len(sampled)))
        for row, seq in enumerate(sampled):
            if seq.forks and not seq.output_token_ids:
                siblings, seq.forks = seq.forks, []
                for sibling in siblings:        # the prompt's, computed once by this sequence
                    sibling.prompt_logprobs = list(seq.prompt_logprobs)
                self.scheduler.fork(seq, siblings)
                seqs.extend(siblings)
                rows.extend([row] * len(siblings))
        self._count_forks()
        return seqs, rows

    def _count_forks(self) -> None:
        s, sch = self.stats, self.scheduler
        s.num_forks, s.num_forked_blocks, s.num_fork_copies = (
            sch.num_forks, sch.num_forked_blocks, sch.num_fork_copies)

    def generate(self, prompts: list[list[int]] | list[str], params: SamplingParams | list[SamplingParams]
                 ) -> list[GenerationResult]:
        """Run prompts to completion (a convenience for tests, benchmarks and the CLI)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{self._arrivals + i}" for i in range(len(prompts))]
        results = {}
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
            results[rid] = GenerationResult(rid, [], None, 0, 0)
        while self.has_unfinished():
            for out in self.step():
                r = results.get(out.request_id)
                if r is None:
                    continue   # a request added through add_request, not ours to collect
                r.token_ids.extend(out.new_token_ids)
                r.logprobs.extend(out.logprobs)
                if out.prompt_logprobs is not None:
                    r.prompt_logprobs = out.prompt_logprobs
                r.num_prompt_tokens, r.num_cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
                if out.finished:
                    r.finish_reason = out.finish_reason
        return [results[rid] for rid in ids]

    def take_events(self) -> list[KVEvent]:
        """Drain the KV events queued since the last call (when nobody subscribed)."""
        return self.pool.take_events()

    def subscribe_events(self, callback: Callable[[list[KVEvent]], None]) -> None:
        """Call `callback` with each batch of KV events, in sequence order, after every step.

        With subscribers, events are delivered to them instead of waiting for `take_events`.
        """
        self._event_subscribers.append(callback)

    def wake_on_store_events(self, wake: Callable[[], None]) -> None:
        """Call `wake` (from any thread) when the shared store has events waiting: the store answers
        on its own threads, often after the engine's last step, and the caller then runs
        `flush_store_events` on the engine thread."""
        if self.tiers is not None and self.tiers.store is not None:
            self.tiers.store.on_events = wake

    def flush_store_events(self) -> None:
        """The shared store's events to the subscribers now, between steps (engine thread)."""
        if self.tiers is not None:
            self.tiers.take_store_events()
        self._publish_events()

    def _publish_events(self) -> None:
        if self._event_subscribers:
            events = self.pool.take_events()
            if events:
                for callback in self._event_subscribers:
                    callback(events)

    def close(self) -> None:
        tiers = getattr(self, "tiers", None)
        if tiers is not None:
            tiers.close()
            self.tiers = None
        if self.tp is not None:
            self.tp.close()
            self.tp = None

    # -- internals ---------------------------------------------------------------
    def _new_sequence(self, request_id: str, prompt: list[int] | str, params: SamplingParams,
                      prefill_only: bool, on_layer_done: LayerCallback | None) -> Sequence:
        params.validate()
        if self.scheduler.find(request_id) is not None or self.scheduler.find_fork(request_id) is not None:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        out_of_vocab = sorted(t for t in params.logit_bias if t >= vocab)
        if out_of_vocab:         # vLLM's words
            raise InvalidRequestError(f"token_id(s) {out_of_vocab} in logit_bias contain out-of-vocab token ids. "
                                      f"Vocabulary size: {vocab}")
        params.check_vocab(vocab)
        params.check_logprobs(self.config.max_logprobs, vocab)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens but this model's context is {self.max_model_len} "
                "tokens (including at least one generated token)")
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            generator = torch.Generator().manual_seed(seed)
            if params.seed is not None:
                skip_draws(generator, params.num_prior_draws, self.model_config.vocab_size)
        grammar = None
        if params.structured is not None:
            prior = ids[len(ids) - params.num_prior_output_tokens:] if params.num_prior_output_tokens else []
            grammar = self.structured_outputs.state(params.structured, prior)
        self._arrivals += 1
        return Sequence(request_id, ids, params, self._arrivals, prefill_only=prefill_only,
                        on_layer_done=on_layer_done, generator=generator, grammar=grammar)

    def _layer_reports(self, chunks: list[ScheduledChunk]) -> list[LayerReport]:
        """The step's sequences that report each layer (prefill-only ones with a callback)."""
        reports = []
        bs = self.config.block_size
        for c in chunks:
            seq = c.seq
            if seq.on_layer_done is None:
                continue
            # The first chunk after admission also reports prefix-cache hits.
            first = 0 if c.admitted else c.start // bs
            end = -(-(c.start + c.num_tokens) // bs)
            reports.append(LayerReport(seq.request_id, first, seq.block_ids[first:end], c.start + c.num_tokens))
        return reports

    def _layer_callback(self, chunks: list[ScheduledChunk], reports: list[LayerReport]
                        ) -> Callable[[int], None] | None:
        if not reports:
            return None
        callbacks = {c.seq.request_id: c.seq.on_layer_done for c in chunks if c.seq.on_layer_done is not None}
        watchers = [(callbacks[r.request_id], r) for r in reports]

        def layer_done(layer: int) -> None:
            for callback, r in watchers:
                callback(LayerReady(r.request_id, layer, r.first_block, r.block_ids, r.num_tokens))
        return layer_done

    def _count(self, chunks: list[ScheduledChunk], num_preempted: int) -> None:
        s = self.stats
        s.num_steps += 1
        s.num_preemptions += num_preempted
        for c in chunks:
            s.num_computed_tokens += c.num_tokens
            prompt_part = max(0, min(c.start + c.num_tokens, len(c.seq.prompt_token_ids)) - c.start)
            s.num_prompt_tokens_computed += prompt_part
        s.num_prefix_hit_tokens = self.scheduler.num_prefix_hit_tokens

    def _append_token(self, seq: Sequence, token: SampledToken) -> RequestOutput:
        seq.output_token_ids.append(token.token_id)
        if seq.token_counts is not None:
            seq.token_counts.add(token.token_id)
        if token.logprob is not None:
            seq.output_logprobs.append(token.top_logprobs or {})
        self.stats.num_generated_tokens += 1
        reason = token_stop_reason(seq.params, self.eos_token_ids, token.token_id, len(seq.output_token_ids))
        if seq.grammar is not None and reason is None and not seq.prefill_only:
            reason = _grammar_stop(seq, token.token_id)
        if seq.prefill_only:
            reason = FinishReason.PREFILL_DONE   # the decode worker judges the first token
        if reason is None and seq.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self.stats.num_finished += 1
        return self._output(seq, [token.token_id], [token] if token.logprob is not None else [])

    def _output(self, seq: Sequence, new_ids: list[int], logprobs: list[SampledToken]) -> RequestOutput:
        prompt_logprobs = None
        if new_ids and seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        return RequestOutput(prompt_logprobs=prompt_logprobs,
            request_id=seq.request_id, new_token_ids=new_ids,
            finished=seq.is_finished, finish_reason=seq.finish_reason,
            num_prompt_tokens=len(seq.prompt_token_ids), num_cached_tokens=seq.num_prefix_hit_tokens,
            num_output_tokens=len(seq.output_token_ids), logprobs=logprobs)


def _grammar_stop(seq: Sequence, token_id: int) -> FinishReason | None:
    """Advance the sequence's grammar; STOP once it is complete (its end token accepted, as
    with ignore_eos) or, should a token the mask allowed be refused, there."""
    matcher = seq.grammar.matcher
    if not matcher.accept_token(token_id):
        log.warning("request %s: token %d was refused by its grammar; stopping", seq.request_id, token_id)
        return FinishReason.STOP
    return FinishReason.STOP if matcher.is_terminated() else None


def _history(seq: Sequence, vocab: int) -> TokenHistory:
    """What a sequence's controls look at: its penalty counts (built on first use from prompt +
    output, then kept by `_append_token`) and, for bad words, the output's last tokens (output
    generated before a migration is the prompt's last `num_prior_output_tokens`)."""
    p = seq.params
    num_generated = len(seq.output_token_ids)
    prior = min(p.num_prior_output_tokens, len(seq.prompt_token_ids))
    if p.has_penalties and seq.token_counts is None:
        seq.token_counts = TokenCounts.of(seq.all_token_ids, prior + num_generated, vocab)
    tail = None
    if p.bad_words:
        k = max(len(w) for w in p.bad_words) - 1
        tail = seq.output_token_ids[-k:] if k else []
        if len(tail) < k and prior:
            tail = seq.prompt_token_ids[len(seq.prompt_token_ids) - prior:][-(k - len(tail)):] + tail
    return TokenHistory([], prior + num_generated, num_generated,
                        seq.token_counts if p.has_penalties else None, tail)


# Stop strings are text, and text is the frontend's work (vLLM's split): the engine stops on
# token ids and counts only, keeps no per-request stop state and never decodes a token.
def token_stop_reason(params: SamplingParams, eos_token_ids: set[int], token_id: int,
                      num_output_tokens: int) -> FinishReason | None:
    """Why the request ends with `token_id`, its `num_output_tokens`-th token; None: it goes on."""
    if not params.ignore_eos and token_id in eos_token_ids:
        return FinishReason.STOP
    if token_id in params.stop_token_ids:
        return FinishReason.STOP
    if num_output_tokens >= params.max_tokens:
        return FinishReason.LENGTH
    return None
