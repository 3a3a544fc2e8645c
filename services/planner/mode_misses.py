"""What a deployment showed about a mode: it missed the SLO with all the workers it may run.

The sizing model compares the two modes by the workers each needs (planner.py). Where
both need more than `max_workers`, or about the same, the model cannot tell which serves
more of the load; how the workers share a machine's cores, the KV transfer and the
router decide it, and the model knows none of them. What each mode served does.

A `ModeMiss` is one such observation: the deployment ran `replicas` (as many workers as
`max_workers` or the pools' `max_replicas` allow), the model gave it no worker to spare,
and the observed TTFT or ITL p90 missed its target in each of the last `MISS_INTERVALS` or
more intervals that began after its last change was ready (`Planner.sustained_miss`). A
miss with a worker to spare is a transient (the backlog after a shift in the mix, say),
not the mode's. The planner keeps the newest per mode for `mode_memory_s`
(`ModeMisses`) and reads it two ways (planner.py, step 4):

- the running mode missed and the model does not rate the other one worse: switch to it,
  unless it too is known to miss at this load;
- a mode known to miss at this load is not switched to, whatever the model says.

"At this load": the miss's load is no more than g = (1 + dead_band) / (1 - dead_band) times
the predicted load, or times one interval's load in the cool-down window, in both prompt and
output tokens/s (the window, because one interval of Poisson arrivals can be well under the
next; the model's switch rule reads the same window). A heavier load cannot do better. So
two modes that both miss cannot flap: the second to miss stays.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from splitserve.services.planner.predictor import PredictedLoad
from splitserve.services.planner.samples import ReplicaCounts

MISS_INTERVALS = 2


@dataclass(frozen=True, slots=True)
class ModeMiss:
    timestamp: float              # the sample that showed it
    replicas: ReplicaCounts       # what ran (its mode: replicas.disaggregated)
    load: PredictedLoad           # the load it missed under (the one the decision planned for)
    seconds: float                # how long it had been missing
    worst: str                    # e.g. "itl p90 0.79 s > 0.4 s"

    @property
    def disaggregated(self) -> bool:
        return self.replicas.disaggregated

    def covers(self, ceiling: PredictedLoad) -> bool:
        """Whether this miss says the mode would miss under `ceiling` (a load already raised by
        the noise ratio g): it missed at no more than that, in prompt and in output tokens/s."""
        return (self.load.prefill_tokens_per_s <= ceiling.prefill_tokens_per_s
                and self.load.decode_tokens_per_s <= ceiling.decode_tokens_per_s)

    def describe(self) -> str:
        mode = "disaggregated" if self.disaggregated else "aggregated"
        return f"{mode} ({self.replicas.describe()}) missed for {self.seconds:.0f} s, {self.worst}"


@dataclass(frozen=True, slots=True)
class ModeMisses:
    """The newest miss of each mode within `memory_s` of the latest sample."""

    misses: tuple[ModeMiss, ...] = ()

    def with_miss(self, miss: ModeMiss, memory_s: float) -> ModeMisses:
        kept = [m for m in self.misses if m.disaggregated != miss.disaggregated]
        return ModeMisses(tuple(m for m in [*kept, miss] if m.timestamp >= miss.timestamp - memory_s))

    def known(self, disaggregated: bool, ceilings: Iterable[PredictedLoad], now: float,
              memory_s: float) -> ModeMiss | None:
        """The miss within memory that says this mode misses under one of `ceilings` (loads
        already raised by g), if any."""
        ceilings = list(ceilings)
        return next((m for m in self.misses if m.disaggregated == disaggregated and m.timestamp >= now - memory_s
                     and any(m.covers(c) for c in ceilings)), None)
