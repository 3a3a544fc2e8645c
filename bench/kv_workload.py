"""Realistic KV block tables for bench/kvtransfer.py: what one remote prefill moves, and its runs.

A prefill worker's and a decode worker's real `Scheduler`s and `BlockPool`s (no model)
serve a mixed, seeded load, as in disaggregated serving: the decode side reserves
blocks for a prompt (reusing its cached prefix), the prefill side computes the prompt
in chunks beside other prompts and keeps its blocks until the transfer is done, then
the decode side decodes the request to its length and frees it. Prompts are a shared
system prompt (one of a few, or none) plus a user part of log-normal length; some are
follow-up turns that extend an earlier conversation, so both prefix caches hit and
evict as they would. Each request's transfer pairs the prefill side's blocks with the
decode side's, past the blocks the decode side already had cached.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from splitserve.kvtransfer.tp_slicing import run_arrays, run_length_histogram
from splitserve.services.engine.block_pool import BlockPool
from splitserve.services.engine.scheduler import Scheduler
from splitserve.services.engine.sequence import FinishReason, Sequence, TransferUse
from splitserve.services.worker_protocol.sampling_params import SamplingParams

SYSTEM_PROMPTS = (0, 300, 1200, 2500)         # shared prefix lengths in tokens (0: none)
FOLLOW_UP = 0.3                               # share of requests that continue an earlier conversation
MAX_CONVERSATION = 12_000                     # tokens; longer conversations are not continued


@dataclass(slots=True)
class Transfer:
    """One request's write: source (prefill) and destination (decode) block ids, in order."""

    request_id: str
    src: list[int]
    dst: list[int]

    @property
    def run_lengths(self) -> np.ndarray:
        return run_arrays(self.src, self.dst)[2]


@dataclass(slots=True)
class Workload:
    transfers: list[Transfer] = field(default_factory=list)
    prefill_hit_blocks: int = 0
    decode_hit_blocks: int = 0

    def histogram(self) -> dict[int, int]:
        """Run length → count over every transfer of the workload."""
        lengths = [t.run_lengths for t in self.transfers]
        return run_length_histogram(np.concatenate(lengths)) if lengths else {}


def _prompt(rng: random.Random, history: list[list[int]], next_token: list[int]) -> list[int]:
    def fresh(n: int) -> list[int]:
        next_token[0] += n
        return list(range(next_token[0] - n, next_token[0]))

    user = fresh(int(min(6000, max(16, rng.lognormvariate(6.3, 0.9)))))
    if history and rng.random() < FOLLOW_UP:
        return rng.choice(history[-32:]) + user
    system = rng.choice(SYSTEM_PROMPTS)
    return list(range(-system, 0)) + user        # negative ids: the shared system prompts' tokens


def simulate(num_blocks: int, block_size: int, num_requests: int, seed: int = 0,
             final_blocks: int | None = None) -> Workload:
    """Serve `num_requests` requests through both schedulers; with `final_blocks`, the last request
    is a follow-up whose new part is that many blocks (the one a benchmark transfers)."""
    rng = random.Random(seed)
    prefill = Scheduler(BlockPool(num_blocks, block_size), 2048, 16)
    decode = Scheduler(BlockPool(num_blocks, block_size), 512, 64)
    out = Workload()
    history: list[list[int]] = []
    next_token = [1]
    arrivals: list[Sequence] = []
    reserved: dict[str, tuple[Sequence, list[int], int]] = {}
    prefilling: dict[str, Sequence] = {}
    sent: list[str] = []
    for i in range(num_requests):
        prompt = _prompt(rng, history, next_token)
        if final_blocks is not None and i == num_requests - 1:
            prompt = (history[-1] if history else []) + list(range(next_token[0],
                                                                   next_token[0] + final_blocks * block_size))
        arrivals.append(Sequence(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(16, 400)), i,
                                 transfer=TransferUse.RECEIVE))
    tick = 0
    while arrivals or reserved or decode.has_work() or prefill.has_work():
        tick += 1
        for rid in sent:                               # last tick's transfers are done
            prefill.transfer_done(rid)
        sent = []
        while arrivals and len(reserved) < 16 and (len(reserved) < 2 or rng.random() < 0.5):
            seq = arrivals[0]
            grant = decode.reserve_remote(seq)
            if grant is None:
                break
            arrivals.pop(0)
            cached = grant.num_cached_tokens // block_size
            out.decode_hit_blocks += cached
            reserved[seq.request_id] = (seq, grant.block_ids, cached)
            remote = Sequence(seq.request_id, list(seq.prompt_token_ids), SamplingParams(max_tokens=1),
                              seq.arrival, prefill_only=True, transfer=TransferUse.SEND)
            prefilling[seq.request_id] = remote
            prefill.add(remote)
        for chunk in _step(prefill):
            remote = chunk.seq
            if not chunk.completes:
                continue
            rid = remote.request_id
            seq, dst, cached = reserved.pop(rid)
            out.prefill_hit_blocks += remote.num_prefix_hit_tokens // block_size
            out.transfers.append(Transfer(rid, remote.block_ids[cached:len(dst)], dst[cached:]))
            prefill.finish(prefilling.pop(rid), FinishReason.LENGTH)
            sent.append(rid)
            decode.complete_remote(rid)
            decode.cache_computed_blocks(seq)
            seq.output_token_ids.append(0)
        for chunk in _step(decode):
            seq = chunk.seq
            if chunk.completes:
                seq.output_token_ids.append(0)
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    if seq.num_tokens < MAX_CONVERSATION:
                        history.append(seq.all_token_ids)
                    decode.finish(seq, FinishReason.LENGTH)
        if tick > 200 * num_requests + 10_000:
            raise RuntimeError("the simulated load did not drain")
    for rid in sent:
        prefill.transfer_done(rid)
    return out


def _step(scheduler: Scheduler):
    """One scheduling step with the model's work pretended done; returns its chunks."""
    decision = scheduler.schedule()
    for chunk in decision.chunks:
        scheduler.advance(chunk)
    return decision.chunks
