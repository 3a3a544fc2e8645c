"""Counts vLLM keeps only in its per-step stats, gathered for the worker's Stats.

vLLM's scheduler reports a preemption as an event of the step (IterationStats), which reaches
its stat loggers and nothing else; `PreemptionCounts` is such a logger, passed to
`LLMEngine.from_engine_args(stat_loggers=...)`. It also adds up the steps' prompt tokens by
source (computed, local prefix cache, read through the KV connector), which a decode worker
with vLLM's NixlConnector reports as its prompt counts. It sees nothing when the engine runs with
`--disable-log-stats` (vLLM then computes no per-step stats).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase


@dataclass(slots=True)
class PromptSources:
    """Prompt tokens since the start, by where their KV came from (vLLM's own accounting)."""

    computed: int = 0
    local_cache_hit: int = 0
    external_kv_transfer: int = 0           # read through the KV connector (a prefill worker's)


class StepCounts:
    """What the loggers add up; read by VllmEngine.load() on another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._preemptions = 0
        self._prompt_sources = PromptSources()

    def add_prompt_sources(self, stats: Any) -> None:
        """One step's prompt tokens by source (vLLM's PromptTokenStats)."""
        with self._lock:
            s = self._prompt_sources
            s.computed += stats.computed
            s.local_cache_hit += stats.local_cache_hit
            s.external_kv_transfer += stats.external_kv_transfer

    @property
    def prompt_sources(self) -> PromptSources:
        with self._lock:
            return replace(self._prompt_sources)

    def add_preemptions(self, n: int) -> None:
        with self._lock:
            self._preemptions += n

    @property
    def preemptions(self) -> int:
        with self._lock:
            return self._preemptions

    def logger_factory(self):
        """A per-engine stat logger factory (vLLM's `PerEngineStatLoggerFactory`) feeding these counts."""
        return lambda vllm_config, engine_index=0: PreemptionCounts(self)


class PreemptionCounts(StatLoggerBase):
    def __init__(self, counts: StepCounts) -> None:      # noqa: D107 (vLLM calls the factory, not this)
        self.counts = counts

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if iteration_stats is None:
            return
        if iteration_stats.num_preempted_reqs:
            self.counts.add_preemptions(iteration_stats.num_preempted_reqs)
        sources = getattr(iteration_stats, "prompt_token_stats", None)
        if sources is not None and sources.total:
            self.counts.add_prompt_sources(sources)

    def log_engine_initialized(self) -> None:
        pass
