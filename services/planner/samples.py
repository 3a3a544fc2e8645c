"""What the planner reads: one planning interval's metrics of a deployment, and its replica counts.

The caller (the `serve --autoscale` loop, the operator) builds one `MetricsSample` per
interval from the frontend's metrics and each worker's Stats, and hands the planner the
recent ones. Everything here is plain data: the planner never asks a live process
anything, so a recorded series replays to the same decisions.

Units are seconds, tokens and requests. Per-interval counts are deltas over the interval
that ends at `timestamp` (a worker's Stats counters minus their value at the previous
sample); gauges are their value at `timestamp`.

Replica counts are what the deployment has *asked for* at the sample, workers still
starting included: the planner reads the time of the last change from them (its
cool-down), and a worker it asked for one interval ago must not be asked for again.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("prefill", "decode", "both")        # services/launch/topology.py's worker roles


@dataclass(frozen=True, slots=True)
class ReplicaCounts:
    """A deployment's workers: disaggregated (a prefill and a decode pool) or aggregated
    (one pool whose workers prefill and decode, topology.py's role "both"); never both kinds."""

    num_prefill: int = 0
    num_decode: int = 0
    num_aggregated: int = 0

    def __post_init__(self) -> None:
        if min(self.num_prefill, self.num_decode, self.num_aggregated) < 0:
            raise ValueError(f"replica counts must be >= 0, got {self}")
        if self.num_aggregated and (self.num_prefill or self.num_decode):
            raise ValueError(f"a deployment is either aggregated or disaggregated, got {self}")

    @classmethod
    def of_pools(cls, num_prefill: int, num_decode: int) -> ReplicaCounts:
        return cls(num_prefill=num_prefill, num_decode=num_decode)

    @classmethod
    def of_aggregated(cls, num_workers: int) -> ReplicaCounts:
        return cls(num_aggregated=num_workers)

    @property
    def disaggregated(self) -> bool:
        return self.num_aggregated == 0

    @property
    def total(self) -> int:
        return self.num_prefill + self.num_decode + self.num_aggregated

    def count(self, pool: str) -> int:
        """The count of one pool: "prefill", "decode" or "aggregated"."""
        if pool == "prefill":
            return self.num_prefill
        if pool == "decode":
            return self.num_decode
        if pool == "aggregated":
            return self.num_aggregated
        raise ValueError(f"unknown pool {pool!r}; pools: prefill, decode, aggregated")

    def describe(self) -> str:
        if self.disaggregated:
            return f"{self.num_prefill}P+{self.num_decode}D"
        return f"{self.num_aggregated}A"


@dataclass(frozen=True, slots=True)
class WorkerLoadSample:
    """One worker at the end of the interval (its Stats)."""

    worker_id: str
    role: str                             # prefill | decode | both
    prefill_queue_tokens: int = 0         # prompt tokens waiting for or in prefill (gauge)
    kv_usage: float = 0.0                 # used / total KV blocks (gauge, Stats.kv_usage)
    num_running_decodes: int = 0          # sequences generating (gauge)
    num_prompt_tokens_computed: int = 0   # prompt tokens prefilled in the interval
    num_generated_tokens: int = 0         # tokens generated in the interval

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"worker {self.worker_id}: role {self.role!r} is not one of {', '.join(ROLES)}")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"worker {self.worker_id}: kv_usage must be within [0, 1], got {self.kv_usage}")


@dataclass(frozen=True, slots=True)
class MetricsSample:
    """One planning interval of one deployment."""

    timestamp: float                      # end of the interval, seconds on any monotonic clock
    interval_s: float                     # the interval's length
    num_arrivals: int                     # requests that arrived at the frontend in the interval
    prompt_tokens_mean: float             # of those arrivals
    prompt_tokens_p90: float
    output_tokens_mean: float             # of the requests that finished in the interval (an arrival's is not known yet)
    replicas: ReplicaCounts               # asked for at `timestamp`, starting workers included
    ttft_p90_s: float | None = None       # observed at the frontend over the interval; None: no first token
    itl_p90_s: float | None = None        # None: no inter-token gap measured
    frontend_queue_depth: int = 0         # requests the frontend holds without a worker (gauge)
    workers: tuple[WorkerLoadSample, ...] = ()

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        if self.num_arrivals < 0 or self.frontend_queue_depth < 0:
            raise ValueError("num_arrivals and frontend_queue_depth must be >= 0")
        if min(self.prompt_tokens_mean, self.prompt_tokens_p90, self.output_tokens_mean) < 0:
            raise ValueError("token lengths must be >= 0")

    @property
    def arrival_rate(self) -> float:
        """Requests per second over the interval."""
        return self.num_arrivals / self.interval_s

    @property
    def prefill_queue_tokens(self) -> int:
        return sum(w.prefill_queue_tokens for w in self.workers)

    @property
    def num_running_decodes(self) -> int:
        return sum(w.num_running_decodes for w in self.workers)

    @property
    def decode_kv_usage(self) -> float:
        """KV in use on the workers that decode, in workers' worth of KV (Σ kv_usage)."""
        return sum(w.kv_usage for w in self.workers if w.role != "prefill")
