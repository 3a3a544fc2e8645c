"""A planner decision and its explanation: inputs, predicted load, chosen counts, what bound them.

Each pool gets a `PoolDecision`: its current count, the count the model needs at the
predicted load, the count chosen, and the `Binding` that set it. `Decision.explain()`
is one log line; `Decision.fields()` is a flat mapping for metrics and Events: its
str and bool values are labels, its numbers gauge values.

Bindings:
- ttft / utilisation: the prefill side's TTFT target or utilisation ceiling (sizing.py);
- itl / kv: the decode side's ITL target or KV memory;
- observed slo: the observed p90 missed its target although the model said the count was
  enough: one more worker (the profile was optimistic; refining it corrects the model);
- bound: min / bound: max / bound: max_workers: a configured bound cut the count;
- cooldown: a lower count would do, but the pool changed less than `cooldown_s` ago;
- hold: a lower count would do at the predicted load, but not for the whole cool-down
  window within the dead band, or the observed latency is too close to its target.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from splitserve.services.planner.predictor import PredictedLoad
from splitserve.services.planner.samples import MetricsSample, ReplicaCounts


class Binding(Enum):
    TTFT = "ttft"
    UTILISATION = "utilisation"
    ITL = "itl"
    KV = "kv"
    OBSERVED_SLO = "observed slo"
    MIN = "bound: min"
    MAX = "bound: max"
    MAX_WORKERS = "bound: max_workers"
    COOLDOWN = "cooldown"
    HOLD = "hold"


@dataclass(frozen=True, slots=True)
class PoolDecision:
    pool: str                 # prefill | decode | aggregated
    current: int
    needed: int               # the model's count at the predicted load, before bounds and hysteresis
    chosen: int
    binding: Binding
    reachable: bool = True    # False: no count meets the SLO at this load (needed is the model's best effort)
    detail: str = ""          # the model's numbers behind `needed`

    @property
    def label(self) -> str:
        """E.g. "prefill: ttft"."""
        return f"{self.pool}: {self.binding.value}"

    def describe(self) -> str:
        counts = f"{self.current}->{self.chosen}" if self.chosen != self.current else f"{self.chosen}"
        unreachable = ", SLO unreachable" if not self.reachable else ""
        detail = f"; {self.detail}" if self.detail else ""
        return f"{self.pool} {counts} [{self.binding.value}, needs {self.needed}{unreachable}{detail}]"


@dataclass(frozen=True, slots=True)
class Decision:
    timestamp: float
    current: ReplicaCounts
    replicas: ReplicaCounts                  # what to run now
    pools: tuple[PoolDecision, ...]          # the pools of the chosen mode
    load: PredictedLoad                      # the load planned for (at the latest sample + worker start-up)
    inputs: MetricsSample                    # the latest sample
    mode_reason: str
    num_samples: int                         # samples read (history and the latest)

    @property
    def changed(self) -> bool:
        return self.replicas != self.current

    @property
    def bindings(self) -> tuple[str, ...]:
        """Each pool's binding label, e.g. ("prefill: ttft", "decode: hold")."""
        return tuple(p.label for p in self.pools)

    def pool(self, name: str) -> PoolDecision | None:
        return next((p for p in self.pools if p.pool == name), None)

    def explain(self) -> str:
        load, seen = self.load, self.inputs
        mode = "disaggregated" if self.replicas.disaggregated else "aggregated"
        trend = f" (trend +{load.trend_per_s:.3g}/s)" if load.trend_per_s > 0 else ""
        return (f"planner: {self.current.describe()} -> {self.replicas.describe()} {mode} ({self.mode_reason}); "
                + "; ".join(p.describe() for p in self.pools)
                + f"; load in {load.horizon_s:.0f} s: {load.arrival_rate:.3g} req/s{trend}, prompt "
                  f"{load.prompt_tokens_mean:.0f} (p90 {load.prompt_tokens_p90:.0f}), output "
                  f"{load.output_tokens_mean:.0f} tokens, prefill {load.prefill_tokens_per_s:.0f} tok/s, decode "
                  f"{load.decode_tokens_per_s:.0f} tok/s, backlog {load.backlog_tokens:.0f} tokens; observed "
                  f"ttft p90 {_seconds(seen.ttft_p90_s)}, itl p90 {_seconds(seen.itl_p90_s)}, "
                  f"queue {seen.frontend_queue_depth}, {self.num_samples} samples")

    def fields(self) -> dict[str, str | bool | int | float]:
        out: dict[str, str | bool | int | float] = {
            "mode": "disaggregated" if self.replicas.disaggregated else "aggregated",
            "changed": self.changed,
            "num_prefill": self.replicas.num_prefill,
            "num_decode": self.replicas.num_decode,
            "num_aggregated": self.replicas.num_aggregated,
            "predicted_arrival_rate": self.load.arrival_rate,
            "predicted_prefill_tokens_per_s": self.load.prefill_tokens_per_s,
            "predicted_decode_tokens_per_s": self.load.decode_tokens_per_s,
            "horizon_s": self.load.horizon_s,
            "observed_arrival_rate": self.inputs.arrival_rate,
            "observed_queue_depth": self.inputs.frontend_queue_depth,
        }
        if self.inputs.ttft_p90_s is not None:
            out["observed_ttft_p90_s"] = self.inputs.ttft_p90_s
        if self.inputs.itl_p90_s is not None:
            out["observed_itl_p90_s"] = self.inputs.itl_p90_s
        for p in self.pools:
            out[f"{p.pool}_current"] = p.current
            out[f"{p.pool}_needed"] = p.needed
            out[f"{p.pool}_chosen"] = p.chosen
            out[f"{p.pool}_binding"] = p.binding.value
            out[f"{p.pool}_reachable"] = p.reachable
        return out


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g} s"
