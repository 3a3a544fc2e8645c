"""Continuous batching with chunked prefill, prefix reuse and preemption by recompute.

Each step spends a token budget: running sequences first (a decoding sequence
costs one token, a long prompt continues its next chunk), then waiting ones in
arrival order, except that a waiting sequence whose next uncached block a running
prefill is computing waits for it (two requests with a new shared prefix compute
it once, not side by side). A sequence's KV blocks grow as it computes; when the pool runs
dry, the most recently admitted running sequence is preempted: its blocks are
released (full ones stay in the prefix cache) and it waits to be recomputed.

The scheduler decides; the engine runs the model and applies results
(`advance`, `finish`). Running out of blocks is never an exception.

A KV transfer may still use a sequence's blocks after it finished: a prefill-only
sequence's blocks are read by the connector that sends them, a given-up remote
prefill's granted blocks may still be written by the prefill worker. `finish` asks
the sequence's `transfer` marker (set when it was created for a transfer) which
blocks the transfer keeps; those move to `transfer_owned` and return to the pool
only at `transfer_done`, the transfer's word that it no longer touches them (the
contract of vLLM's KV connector: `request_finished` delays the free, the worker's
`finished_sending` frees).

Several samples of one prompt (n > 1) prefill it once: when the first sequence's prefill
completes, `fork` gives each sibling the prompt's full blocks by reference and a copy of the
last partial block (copy-on-write, made before the next step writes: `block_copies`). A
sibling that finds no block for its copy waits instead and is recomputed from the prefix
cache, like a preempted sequence. Forked siblings join the running batch beyond
max_num_seqs if need be: they were admitted with their parent.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from splitserve.block_hashes import block_hashes, salted_key
from splitserve.services.engine_api.contract import Reservation
from splitserve.services.engine.block_pool import BlockPool
from splitserve.services.engine.sequence import FinishReason, Sequence, SequenceStatus, TransferUse

if TYPE_CHECKING:
    from splitserve.services.engine.kv_tiers.tiers import KVTiers


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int          # num_computed_tokens before this step
    num_tokens: int     # tokens computed this step
    admitted: bool = False   # first chunk since the sequence was (re)admitted

    @property
    def completes(self) -> bool:
        """True when this chunk computes the last pending token, so a token is sampled."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)   # (src, dst), before the step

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(slots=True)
class TransferHold:
    """Blocks of a finished request that a KV transfer still uses, and what for."""

    use: TransferUse
    block_ids: list[int]


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_batched_tokens: int, max_num_seqs: int,
                 extra_key: bytes = b"", tiers: KVTiers | None = None):
        self.pool = pool
        self.tiers = tiers              # host/disk tiers below the pool (kv_tiers/), or None
        self.block_size = pool.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.extra_key = extra_key
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []          # in arrival order
        self.remote: dict[str, Sequence] = {}      # reserved for a remote prefill
        # Finished requests' blocks that a transfer still reads or may still write: out of
        # the pool until transfer_done(request_id).
        self.transfer_owned: dict[str, TransferHold] = {}
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0
        self.num_tier_hit_tokens = 0        # of those, loaded back from a lower tier
        # Copy-on-write copies not yet run; both blocks hold an extra reference until then, so
        # neither can be reused (or written by a transfer) before the copy reads or writes it.
        self.pending_copies: list[tuple[int, int]] = []
        self.num_forks = 0                  # sequences that took a sibling's prompt blocks
        self.num_forked_blocks = 0          # full blocks shared by reference at a fork
        self.num_fork_copies = 0            # partial blocks copied at a fork

    # -- queries -----------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pending_copies)

    @property
    def num_remote_blocks(self) -> int:
        """Blocks reservations allocated for prompts a remote prefill has not filled yet (their
        prefix-cache hits, which other requests may share, left out)."""
        return sum(len(seq.block_ids) - seq.num_cached_blocks for seq in self.remote.values())

    def find(self, request_id: str) -> Sequence | None:
        """A sequence that is waiting, running or reserved (not finished ones)."""
        for seq in (*self.running, *self.waiting, *self.remote.values()):
            if seq.request_id == request_id:
                return seq
        return None

    def find_fork(self, request_id: str) -> tuple[Sequence, Sequence] | None:
        """(parent, sibling) for a sibling still waiting for its parent's prefill."""
        for seq in (*self.running, *self.waiting, *self.remote.values()):
            for sibling in seq.forks:
                if sibling.request_id == request_id:
                    return seq, sibling
        return None

    # -- admission ---------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._enqueue_waiting(seq)

    def reserve_remote(self, seq: Sequence, allow_full: bool = True) -> Reservation | None:
        """Reserve blocks for the whole prompt (reusing cached prefix blocks); None if that would
        leave fewer free blocks than running sequences (each may need its next block before the
        prompt arrives: a queue of reservations must not preempt the decodes it waits to join).
        With `seq.transfer` RECEIVE, giving it up leaves the granted blocks to the transfer."""
        hits = self._prefix_hits(seq, allow_full=allow_full)
        lower = self._lower_tier_hits(seq, len(hits), len(seq.prompt_token_ids) // self.block_size
                                      if allow_full else self._max_hits(seq))
        num_new = self._blocks_for(len(seq.prompt_token_ids)) - len(hits)
        idle_hits = sum(b in self.pool.evictable for b in hits)       # taking them makes them unfree
        if self.pool.num_free_blocks - idle_hits - num_new < len(self.running):
            return None
        self.pool.take_refs(hits)
        new_ids = self.pool.allocate(num_new, after=hits[-1] if hits else None)
        if new_ids is None:
            self.pool.release(hits)
            return None
        seq.block_ids = hits + new_ids
        seq.num_cached_blocks = len(hits)
        self._load_lower(seq, lower)
        seq.num_prefix_hit_tokens = seq.num_cached_blocks * self.block_size
        self.num_prefix_hit_tokens += seq.num_prefix_hit_tokens
        seq.status = SequenceStatus.REMOTE_PREFILL
        self.remote[seq.request_id] = seq
        return Reservation(list(seq.block_ids), seq.num_prefix_hit_tokens)

    def complete_remote(self, request_id: str, num_computed_tokens: int | None = None) -> Sequence | None:
        """The remote prefill filled the reserved blocks (the KV of `num_computed_tokens`, default
        the whole prompt; the rest is computed here): join the running batch."""
        seq = self.remote.pop(request_id, None)
        if seq is None:
            return None
        seq.num_computed_tokens = len(seq.prompt_token_ids) if num_computed_tokens is None else num_computed_tokens
        seq.transfer = None          # every write landed: an ordinary sequence from now on
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.arrival)
        return seq

    # -- one step ----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue   # preempted earlier in this loop
            n = min(seq.num_pending_tokens, budget)
            if n == 0:
                continue
            if not self._grow_or_preempt(seq, seq.num_computed_tokens + n, out):
                continue
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        if not out.preempted:
            self._admit_waiting(out, budget)
        # Single-token chunks first: the model attends them as one decode batch.
        out.chunks.sort(key=lambda c: c.num_tokens != 1)
        if out.chunks:
            out.block_copies, self.pending_copies = self.pending_copies, []
        else:
            # Nothing runs, so no sequence is left to read the copies: drop them.
            self.copies_done(self.pending_copies)
            self.pending_copies = []
        return out

    def copies_done(self, copies: list[tuple[int, int]]) -> None:
        """The model ran these copies (or they are moot): drop the references they held."""
        for src, dst in copies:
            self.pool.release([src, dst])

    # -- forks (n > 1) -------------------------------------------------------------
    def fork(self, parent: Sequence, siblings: list[Sequence], num_tokens: int | None = None) -> None:
        """`parent` holds its whole prompt's KV (and nothing more): each sibling shares the blocks
        wholly below `num_tokens` (default: the prompt) and gets its own copy of the prompt's
        block holding position `num_tokens`, if any, then runs beside it, computing from
        `num_tokens` on (or, with no block left for the copy, waits to be recomputed from the
        prefix cache). `num_tokens` one short of the prompt: the sibling recomputes the last
        prompt token for its own logits (a fork after a remote prefill, which sent KV only)."""
        num_prompt = len(parent.prompt_token_ids)
        num_tokens = num_prompt if num_tokens is None else num_tokens
        num_full = num_tokens // self.block_size
        shared = parent.block_ids[:num_full]
        partial = parent.block_ids[num_full:self._blocks_for(num_prompt)]
        for sib in siblings:
            copy = self.pool.allocate(len(partial))
            if copy is None:
                sib.status = SequenceStatus.WAITING
                self._enqueue_waiting(sib)
                continue
            if partial:
                self.pool.take_refs([partial[0], copy[0]])   # held until the copy ran
                self.pending_copies.append((partial[0], copy[0]))
                self.num_fork_copies += 1
            self.pool.take_refs(shared)
            self.num_forks += 1
            self.num_forked_blocks += len(shared)
            sib.block_ids = shared + copy
            sib.block_hashes = parent.block_hashes[:num_full]
            sib.num_cached_blocks = min(parent.num_cached_blocks, num_full)
            sib.num_computed_tokens = num_tokens
            sib.num_prefix_hit_tokens = parent.num_prefix_hit_tokens
            sib.status = SequenceStatus.RUNNING
            bisect.insort(self.running, sib, key=lambda s: s.arrival)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences in arrival order while blocks, budget and seats last. A sequence
        whose next uncached block a running prefill is computing right now waits (and the ones
        behind it may go first): next step that block is cached, so the prefix is computed once."""
        pending = self._blocks_being_computed()
        held: list[Sequence] = []
        try:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                hits = self._prefix_hits(seq, allow_full=False)
                lower = self._lower_tier_hits(seq, len(hits), self._max_hits(seq))
                if len(hits) + lower < len(seq.block_hashes) and seq.block_hashes[len(hits) + lower] in pending:
                    held.append(self.waiting.popleft())
                    continue
                start = (len(hits) + lower) * self.block_size
                n = min(seq.num_tokens - start, budget)
                self.pool.take_refs(hits)
                new_ids = self.pool.allocate(self._blocks_for(start + n) - len(hits),
                                             after=hits[-1] if hits else None)
                if new_ids is None:
                    self.pool.release(hits)
                    break
                self.waiting.popleft()
                seq.block_ids = hits + new_ids
                seq.num_cached_blocks = len(hits)
                if lower:
                    # A block that fails its check is recomputed: the chunk starts there instead
                    # (the blocks allocated cover that too: fewer loaded means no more blocks).
                    self._load_lower(seq, lower)
                    start = seq.num_cached_blocks * self.block_size
                    n = min(seq.num_tokens - start, budget)
                seq.num_computed_tokens = start
                seq.num_prefix_hit_tokens += start
                self.num_prefix_hit_tokens += start
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.chunks.append(ScheduledChunk(seq, start, n, admitted=True))
                budget -= n
                pending.update(seq.block_hashes[len(hits):])
        finally:
            self.waiting.extendleft(reversed(held))

    def _blocks_being_computed(self) -> set[bytes]:
        """Hashes of the full blocks that running sequences have hashed but not yet computed and
        cached: the rest of a prefill in progress."""
        pending: set[bytes] = set()
        for seq in self.running:
            pending.update(seq.block_hashes[seq.num_cached_blocks:])
        return pending

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        need = self._blocks_for(num_tokens) - len(seq.block_ids)
        while need > 0:
            new_ids = self.pool.allocate(need, after=seq.block_ids[-1] if seq.block_ids else None)
            if new_ids is not None:
                seq.block_ids.extend(new_ids)
                return True
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.release(seq.block_ids)
        seq.block_ids = []
        seq.num_cached_blocks = 0
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._enqueue_waiting(seq)

    # -- results -----------------------------------------------------------------
    def advance(self, chunk: ScheduledChunk) -> None:
        """The model computed this chunk: count it and register its full blocks."""
        seq = chunk.seq
        seq.num_computed_tokens = chunk.start + chunk.num_tokens
        self.cache_computed_blocks(seq)

    def cache_computed_blocks(self, seq: Sequence) -> None:
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_cached_blocks:
            return
        tokens = seq.all_token_ids
        if len(seq.block_hashes) < num_full:
            # Hashes of blocks beyond the computed ones stay: tokens are only appended, and
            # _blocks_being_computed reads them.
            seq.block_hashes = block_hashes(tokens[:num_full * self.block_size], self.block_size,
                                            self.hash_key(seq), seq.block_hashes)
        for b in range(seq.num_cached_blocks, num_full):
            parent = seq.block_hashes[b - 1] if b else None
            self.pool.cache_block(seq.block_ids[b], seq.block_hashes[b], parent,
                                  tokens[b * self.block_size:(b + 1) * self.block_size])
        seq.num_cached_blocks = num_full

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take the sequence out of every queue and release its blocks, except those its
        transfer still uses (`transfer_owned`, until `transfer_done`)."""
        kept = self._kept_by_transfer(seq, reason)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.REMOTE_PREFILL:
            self.remote.pop(seq.request_id, None)
        if kept is None:
            self.pool.release(seq.block_ids)
        else:
            self.pool.release(seq.block_ids[:len(seq.block_ids) - len(kept)])
            hold = self.transfer_owned.setdefault(seq.request_id, TransferHold(seq.transfer, []))
            hold.block_ids.extend(kept)   # a request id given up twice (a retry) keeps both
        seq.block_ids = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    @staticmethod
    def _kept_by_transfer(seq: Sequence, reason: FinishReason) -> list[int] | None:
        """The tail of the finishing sequence's blocks that its transfer still uses; None
        when the transfer (if any) is over.

        SEND: a prefill that finished: every block, until the connector has sent them; an
        aborted one sends nothing more. RECEIVE: a reservation given up before it was
        filled: the blocks granted to the writer, which one-sided writes may still reach
        (the leading cached-prefix blocks were not granted and go back).
        """
        if seq.transfer is TransferUse.SEND and reason is not FinishReason.ABORT:
            return list(seq.block_ids)
        if seq.transfer is TransferUse.RECEIVE and seq.status is SequenceStatus.REMOTE_PREFILL:
            return seq.block_ids[seq.num_cached_blocks:]
        return None

    def transfer_done(self, request_id: str) -> bool:
        """The transfer no longer touches `request_id`'s blocks: back to the pool. False if
        no transfer held any."""
        hold = self.transfer_owned.pop(request_id, None)
        if hold is None:
            return False
        self.pool.release(hold.block_ids)
        return True

    # -- helpers -----------------------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def hash_key(self, seq: Sequence) -> bytes:
        """The extra key of `seq`'s block hashes: the engine's, salted by its cache_salt."""
        return salted_key(self.extra_key, seq.params.cache_salt)

    def _prefix_hits(self, seq: Sequence, allow_full: bool) -> list[int]:
        tokens = seq.all_token_ids
        seq.block_hashes = block_hashes(tokens, self.block_size, self.hash_key(seq), seq.block_hashes)
        hits = self.pool.cached_prefix(seq.block_hashes)
        if not allow_full:
            hits = hits[:self._max_hits(seq)]
        return hits

    def _max_hits(self, seq: Sequence) -> int:
        """Leading blocks a local prefill may take from a cache: none where the prompt's logits are
        wanted, and never the last token (it must be computed to sample from its logits)."""
        return 0 if seq.needs_prompt_logits else (seq.num_tokens - 1) // self.block_size

    def _lower_tier_hits(self, seq: Sequence, num_hits: int, limit: int) -> int:
        """Blocks after the pool's hits that a lower tier holds (looked up, not yet read)."""
        if self.tiers is None or not self.pool.enable_prefix_caching or num_hits >= limit:
            return 0
        return self.tiers.lookup(seq.block_hashes[num_hits:limit], protect=True)

    def _load_lower(self, seq: Sequence, lower: int) -> None:
        """Load up to `lower` blocks after the cached ones into the sequence's next (new) blocks,
        register them in the pool's prefix cache and count them as cached."""
        if not lower:
            return
        first = seq.num_cached_blocks
        loaded = self.tiers.load(seq.block_hashes[first:first + lower], seq.block_ids[first:first + lower])
        tokens = seq.all_token_ids
        for b in range(first, first + loaded):
            self.pool.cache_block(seq.block_ids[b], seq.block_hashes[b], seq.block_hashes[b - 1] if b else None,
                                  tokens[b * self.block_size:(b + 1) * self.block_size])
        seq.num_cached_blocks = first + loaded
        self.num_tier_hit_tokens += loaded * self.block_size

    def _enqueue_waiting(self, seq: Sequence) -> None:
        if not self.waiting or self.waiting[-1].arrival < seq.arrival:
            self.waiting.append(seq)
            return
        idx = bisect.bisect([s.arrival for s in self.waiting], seq.arrival)
        self.waiting.insert(idx, seq)
