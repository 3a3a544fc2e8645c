"""How many compute threads a pinned rank steps with while other processes use its cores.

A rank pinned to C cores steps with C torch (OpenMP) threads, and they meet at the end of every
operator. A process that is not the rank's (a benchmark client on the same laptop, an editor, a
test suite) gets its CPU time from those same cores: the thread whose core it takes falls behind
and every other thread waits for it, at every operator, so a client using most of one core of
two costs a step about as much as losing the core would, and more once the waiting threads spin.
vLLM's CPU backend keeps cores free of compute on every machine (vllm/utils/ompmultiprocessing.py,
0.32: with `VLLM_CPU_OMP_THREADS_BIND=auto`, one core per local rank for its scheduler process,
which polls); on 2 cores that halves compute even when nothing else runs (bench/README.md, peers.py).

So a rank measures, about once a second, how much of its cores other processes used (the cores'
busy time in /proc/stat less this process's own CPU time: every thread of the process is pinned to
them) and steps with one thread fewer for each core's worth of that use: a thread is given up
from `YIELD_FROM` of a core and taken back once the use is below `RECLAIM_BELOW` of the cores
still given up (the gap keeps a steady client from flipping the count every second). On an
oversubscribed machine (others using more than all the rank's cores but one) it gives nothing up:
they would contend for the cores it kept too, and there each thread is a share of the CPU that the
scheduler hands out (a noisy A/B at a load average of 6 on 2 cores: 5.8 tok/s with two threads,
3.1 with one).

Torch's thread count belongs to the thread that sets it (OpenMP keeps it per thread), so the
engine's step thread applies it itself, between steps (`before_step`). The thread count only ever
goes down from the configured one, to at least one thread.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

YIELD_FROM = 0.35        # cores' worth of other processes' use that costs the rank one thread
RECLAIM_BELOW = 0.15     # ... and that, once under it, gives the thread back
OVERFLOW_FROM = 0.15     # others' use beyond all cores but one (in cores) at which nothing is given up
OVERFLOW_KEEP = 0.3      # ... and at which the cores given up are taken back
INTERVAL_S = 1.0         # how often a rank measures
STALE_S = 5.0            # a longer window (the rank was idle) is started over, not averaged


@dataclass(slots=True, frozen=True)
class CoreTimes:
    """CPU seconds spent so far on a set of cores (by anything) and by this process."""

    cores_busy_s: float
    own_s: float


def read_core_times(cores: tuple[int, ...], stat: Path = Path("/proc/stat")) -> CoreTimes:
    """The busy time of `cores` (user, nice, system, irq, softirq, steal; not idle or iowait)
    from /proc/stat, and this process's user + system time."""
    wanted = {f"cpu{c}" for c in cores}
    busy = 0
    for line in stat.read_text().splitlines():
        name, _, rest = line.partition(" ")
        if name in wanted:
            v = [int(x) for x in rest.split()[:8]]
            busy += sum(v) - v[3] - v[4]
    own = os.times()
    return CoreTimes(busy / os.sysconf("SC_CLK_TCK"), own.user + own.system)


def foreign_cores(before: CoreTimes, after: CoreTimes, elapsed_s: float) -> float:
    """Cores' worth of CPU time on the cores, over `elapsed_s`, that this process did not use."""
    if elapsed_s <= 0:
        return 0.0
    other = (after.cores_busy_s - before.cores_busy_s) - (after.own_s - before.own_s)
    return max(other, 0.0) / elapsed_s


def yielded_cores(foreign: float, yielded: int, num_cores: int) -> int:
    """How many of `num_cores` cores to leave to other processes that used `foreign` cores' worth
    of them, `yielded` being left now. Never all of them: the rank keeps one thread. And none when
    they use more than all the cores but one: then they contend for every core whatever the rank
    leaves them, and each thread it keeps is one more share of the CPU that the scheduler hands out."""
    if num_cores < 2 or foreign > num_cores - 1 + (OVERFLOW_KEEP if yielded else OVERFLOW_FROM):
        return 0
    more = math.ceil(round(foreign - YIELD_FROM, 6))       # a thread given up per started core of use
    fewer = math.ceil(round(foreign - RECLAIM_BELOW, 6))   # ... and taken back only well below it
    return min(max(more, min(yielded, fewer), 0), num_cores - 1)


class CoreSharing:
    """The compute thread count of one rank pinned to `cores`, at most `max_threads`, adjusted
    between steps to what other processes leave of the cores. Call `before_step` from the thread
    that runs the steps (the thread count it sets is that thread's)."""

    def __init__(self, cores: tuple[int, ...], max_threads: int,
                 read: Callable[[tuple[int, ...]], CoreTimes] = read_core_times,
                 set_threads: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, interval_s: float = INTERVAL_S):
        self.cores = cores
        self.max_threads = max_threads
        self.threads = max_threads
        self.yielded = 0               # cores left to other processes now
        self.foreign = 0.0             # their use in the last window, in cores
        self._read, self._clock, self._interval_s = read, clock, interval_s
        self._told = False
        self._set_threads = set_threads or _set_torch_threads
        self._since, self._since_at = read(cores), clock()

    def before_step(self) -> None:
        now = self._clock()
        if now - self._since_at < self._interval_s:
            return
        sample = self._read(self.cores)
        (before, before_at), (self._since, self._since_at) = (self._since, self._since_at), (sample, now)
        if now - before_at > STALE_S:
            return                  # the rank was idle: measure the next second instead
        self.foreign = foreign_cores(before, sample, now - before_at)
        self._apply(yielded_cores(self.foreign, self.yielded, len(self.cores)))

    def _apply(self, yielded: int) -> None:
        threads = max(1, min(self.max_threads, len(self.cores) - yielded))
        self.yielded = yielded
        if threads == self.threads:
            return
        # The first change says what is going on (serve logs warnings only); later ones are routine.
        level = logging.WARNING if not self._told else logging.INFO
        self._told = True
        log.log(level, "other processes use %.2f of cores %s: stepping with %d compute thread(s) (was %d; "
                "--cpu-yield off keeps one per core)", self.foreign, ",".join(map(str, self.cores)), threads,
                self.threads)
        self._set_threads(threads)
        self.threads = threads


def _set_torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
