"""Which CPU cores a worker's compute threads run on.

torch's OpenMP threads meet at the end of every operator, so a rank whose threads share
cores with another rank's wait for it at every step; `splitserve serve` gives every worker's
ranks cores of their own (`plan_cores`), and each worker pins itself with `pin`. vLLM's CPU
backend also reserves a core for its frontend process; `plan_cores` does that only on
machines where one core is a small share (bench/README.md, `peers.py`: on 2 cores the
reserve halved a worker's compute for a frontend that needed a few percent of a core). With
`--cpu-yield auto` (core_sharing.py; off by default: not faster where measured, bench/README.md) a
pinned rank gives cores up while other processes use them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from splitserve.services.engine.core_sharing import CoreSharing


def parse_cores(text: str) -> tuple[int, ...]:
    """'0-3,6' → (0, 1, 2, 3, 6): the list syntax of taskset and cpusets."""
    cores: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            lo, _, hi = part.partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 0 or last < first:
                raise ValueError(part)
            cores.extend(range(first, last + 1))
    except ValueError:
        raise InvalidRequestError(f"bad core list {text!r}: use e.g. 0-3,6") from None
    if not cores:
        raise InvalidRequestError(f"bad core list {text!r}: no core named")
    return tuple(sorted(set(cores)))


def format_cores(cores: tuple[int, ...] | list[int]) -> str:
    return ",".join(str(c) for c in cores)


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def rank_cores(cores: tuple[int, ...], tp: int, rank: int) -> tuple[int, ...]:
    """Rank `rank`'s share of a worker's cores: contiguous equal slices; with fewer cores than
    ranks, one core each, shared round robin."""
    if len(cores) < tp:
        return (cores[rank % len(cores)],)
    per = len(cores) // tp
    return cores[rank * per:(rank + 1) * per]


# On 2 cores, keeping one for the frontend and the client (vLLM's CPU default) cost a
# single aggregated worker 41 % of its output at concurrency 16 (bench/peers.py: 34.8
# against 58.8 tok/s with both cores); the frontend and `splitserve bench` used a few
# hundredths of a core. A reserved core pays off only where it is a small share.
RESERVE_FROM_CORES = 8


@dataclass(slots=True, frozen=True)
class CorePlan:
    reserved: tuple[int, ...]                   # left to the frontend, the client, the OS
    workers: tuple[tuple[int, ...] | None, ...]  # per worker (all its ranks); None: not pinned


def plan_cores(available: list[int], ranks_per_worker: list[int], reserved: int | None = None) -> CorePlan:
    """Share `available` cores out among workers. `reserved` cores stay free for the processes
    that are not workers (None: one on machines of `RESERVE_FROM_CORES` cores or more, when the
    rest still give every rank a core of its own; none on smaller ones). With fewer cores than
    ranks nothing is pinned: ranks would have to share cores anyway."""
    total = sum(ranks_per_worker)
    if reserved is None:
        reserved = 1 if len(available) >= RESERVE_FROM_CORES and len(available) - 1 >= total else 0
    if reserved < 0 or reserved >= len(available):
        raise InvalidRequestError(
            f"--reserved-cores {reserved}: this machine gives {len(available)} core(s); reserve fewer")
    kept, usable = tuple(available[:reserved]), available[reserved:]
    if len(usable) < total:
        return CorePlan(kept, tuple(None for _ in ranks_per_worker))
    # Cores in proportion to ranks; the remainder goes to the first workers.
    extra = len(usable) - total
    shares = [r + extra * r // total for r in ranks_per_worker]
    for i in range(len(usable) - sum(shares)):
        shares[i % len(shares)] += 1
    plans, start = [], 0
    for n in shares:
        plans.append(tuple(usable[start:start + n]))
        start += n
    return CorePlan(kept, tuple(plans))


def pin(cores: tuple[int, ...]) -> None:
    """Pin every thread this process has now (torch's pool may exist already) to `cores`;
    threads started later inherit it."""
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    for tid in tasks:
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:
            pass                   # a thread that ended meanwhile
        except OSError as exc:
            raise InvalidRequestError(f"cannot pin to cores {format_cores(cores)}: {exc}") from None


def adapts_threads(cores: tuple[int, ...] | None, threads: int | None, cpu_yield: bool) -> bool:
    """Whether a rank with these cores and threads steps with fewer threads while other processes
    use its cores (core_sharing.py): pinned, more than one thread, no more threads than cores."""
    return bool(cpu_yield and cores and threads and 1 < threads <= len(cores))


def apply_rank_threads(config, rank: int) -> CoreSharing | None:
    """Pin this process (rank `rank` of `config`, an EngineConfig) and set torch's threads.
    Returns what fits the thread count to the other processes on the rank's cores (None where
    `adapts_threads` says no): its `before_step` belongs in the thread that runs the steps."""
    import torch

    from splitserve.services.engine.core_sharing import CoreSharing

    cores, threads = config.rank_threads(rank)
    if cores:
        pin(cores)
    if threads:
        torch.set_num_threads(threads)
    return CoreSharing(cores, threads) if adapts_threads(cores, threads, config.cpu_yield) else None
