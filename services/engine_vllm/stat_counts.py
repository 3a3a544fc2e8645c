"""Counts vLLM keeps only in its per-step stats, gathered for the worker's Stats.

vLLM's scheduler reports a preemption as an event of the step (IterationStats), which reaches
its stat loggers and nothing else; `PreemptionCounts` is such a logger, passed to
`LLMEngine.from_engine_args(stat_loggers=...)`. It sees nothing when the engine runs with
`--disable-log-stats` (vLLM then computes no per-step stats).
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase


class StepCounts:
    """What the loggers add up; read by VllmEngine.load() on another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._preemptions = 0

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
        if iteration_stats is not None and iteration_stats.num_preempted_reqs:
            self.counts.add_preemptions(iteration_stats.num_preempted_reqs)

    def log_engine_initialized(self) -> None:
        pass
