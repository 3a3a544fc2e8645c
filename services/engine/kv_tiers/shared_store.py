"""The shared block store as the engine sees it: a tier below disk, and when a fetch pays.

The engine does not know how the store is reached; the worker attaches a `SharedStore`
(services/engine/kv_tiers/store_client.py: gRPC control, kvtransfer bytes) to its `KVTiers`.

When to fetch (`FetchRule`). A prefix the store holds is fetched only when that is expected
to be quicker than computing it again:

    fetch_s(n)     = rtt_s + n × block_fetch_s
    recompute_s(n) = n × block_size / prefill_tokens_per_s

`rtt_s` is the store client's moving average of its Lookup calls (a round trip that moves no block), `block_fetch_s` on
every fetch ((seconds − rtt) / blocks), `prefill_tokens_per_s` on every engine step that
computed at least MIN_PREFILL_TOKENS prompt tokens (prompt tokens ÷ the step's seconds: the
decodes in the same step make it a low estimate of the prefill speed, i.e. it leans towards
fetching). Each is an exponential moving average (weight ALPHA for the newest sample), and
until a rate has been measured the rule fetches (the defaults below are this project's
measurements on the 2-core EPYC: a SmolLM2 block of 16 tokens is ~59 ms to compute and
~1 ms to fetch over loopback).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

ALPHA = 0.2
MIN_PREFILL_TOKENS = 32


class SharedStore(Protocol):
    """A block store several engines share. Every method is called on the engine thread."""

    round_trip_s: float                  # moving average of a Lookup's round trip
    occupancy: tuple[int, int]           # the store's (blocks held, capacity) as last seen
    # Called from any thread when events wait in `take_events` (the worker's engine loop then
    # takes them on the engine thread): the store answers after the step that published, and an
    # idle engine has no next step.
    on_events: Callable[[], None] | None

    def lookup(self, block_hashes: list[bytes]) -> int:
        """Leading hashes the store holds; 0 when it cannot be reached (never raises)."""

    def fetch(self, block_hashes: list[bytes], block_ids: list[int], pool: torch.Tensor) -> int:
        """Copy the leading held blocks into `pool`'s `block_ids`, each verified (CRC-32 as published,
        layout by the transfer's handshake); the number copied. Failures are counted, not raised."""

    def publish(self, pool: torch.Tensor, blocks: list[tuple[int, bytes]]) -> None:
        """Offer these computed blocks (id in `pool`, hash) to the store. Copies what it sends before
        returning (the pool may reuse the blocks right after); the sending happens behind."""

    def take_events(self) -> list[tuple[str, tuple[bytes, ...]]]:
        """("stored" | "removed", hashes) since the last call, in order: what the store took from this
        engine or evicted for it, for the router (an empty "stored" when it attached)."""

    def rejections(self) -> dict[str, int]:
        """reason -> blocks not loaded or not published because of a failure (store_unavailable, ...)."""

    def close(self) -> None: ...


@dataclass(slots=True)
class FetchRule:
    block_size: int
    rtt_s: float = 1e-3
    block_fetch_s: float = 1e-3
    prefill_tokens_per_s: float | None = None

    def should_fetch(self, num_blocks: int) -> bool:
        if num_blocks <= 0:
            return False
        if self.prefill_tokens_per_s is None:
            return True
        return self.fetch_s(num_blocks) < self.recompute_s(num_blocks)

    def fetch_s(self, num_blocks: int) -> float:
        return self.rtt_s + num_blocks * self.block_fetch_s

    def recompute_s(self, num_blocks: int) -> float:
        rate = self.prefill_tokens_per_s or float("inf")
        return num_blocks * self.block_size / rate

    def observe_fetch(self, num_blocks: int, seconds: float) -> None:
        if num_blocks > 0:
            per_block = max(seconds - self.rtt_s, 0.0) / num_blocks
            self.block_fetch_s += ALPHA * (per_block - self.block_fetch_s)

    def observe_prefill(self, prompt_tokens: int, seconds: float) -> None:
        if prompt_tokens < MIN_PREFILL_TOKENS or seconds <= 0:
            return
        rate = prompt_tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old is None else old + ALPHA * (rate - old)
