"""When requests start: open-loop schedules and closed-loop concurrency.

Open loop (Poisson, constant rate, trace schedule): conversations start at
times fixed in advance, whatever the server's speed, which is how real users
arrive and what exposes queueing. `start_times(conversations)` yields the start
offset in seconds of each conversation in order, and `schedule` pairs them
up. Closed loop (fixed concurrency): N clients each start the next
conversation as their previous one ends; there is no schedule
(`schedule` returns None) and the runner keeps N in flight.

Rates count conversations (each turn of a multi-turn session is sent after the
previous answer). Every process is seeded or deterministic.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from splitserve.errors import SplitserveError

from splitserve.loadgen.workloads import Conversation


class _OpenLoop:
    __slots__ = ()

    def schedule(self, conversations: Iterable[Conversation]) -> Iterator[tuple[float, Conversation]]:
        """(start offset, conversation) pairs, in order."""
        a, b = itertools.tee(conversations)
        return zip(self.start_times(a), b)


@dataclass(slots=True, frozen=True)
class Poisson(_OpenLoop):
    rate: float
    seed: int = 0
    name = "poisson"

    def start_times(self, conversations: Iterable[Conversation]) -> Iterator[float]:
        rng = random.Random(f"poisson:{self.seed}")
        t = 0.0
        for _ in conversations:
            yield t
            t += rng.expovariate(self.rate)

    def with_rate(self, rate: float) -> "Poisson":
        return Poisson(rate, self.seed)

    def describe(self) -> dict:
        return {"kind": self.name, "rate": self.rate, "seed": self.seed}


@dataclass(slots=True, frozen=True)
class Constant(_OpenLoop):
    rate: float
    name = "constant"

    def start_times(self, conversations: Iterable[Conversation]) -> Iterator[float]:
        for i, _ in enumerate(conversations):
            yield i / self.rate

    def with_rate(self, rate: float) -> "Constant":
        return Constant(rate)

    def describe(self) -> dict:
        return {"kind": self.name, "rate": self.rate}


@dataclass(slots=True, frozen=True)
class TraceSchedule(_OpenLoop):
    """The trace's own timestamps (scaled in time by the workload, `--trace-time-scale`)."""

    name = "trace"

    def start_times(self, conversations: Iterable[Conversation]) -> Iterator[float]:
        for conv in conversations:
            if conv.arrival_s is None:
                raise SplitserveError("trace-schedule arrivals need a workload with timestamps (--workload trace)")
            yield conv.arrival_s

    def describe(self) -> dict:
        return {"kind": self.name}


@dataclass(slots=True, frozen=True)
class Concurrency:
    num_clients: int
    name = "concurrency"

    def start_times(self, conversations: Iterable[Conversation]) -> None:
        return None

    def schedule(self, conversations: Iterable[Conversation]) -> None:
        return None

    def describe(self) -> dict:
        return {"kind": self.name, "concurrency": self.num_clients}


Arrivals = Poisson | Constant | TraceSchedule | Concurrency


def make_arrivals(kind: str, *, rate: float | None = None, concurrency: int | None = None,
                  seed: int = 0) -> Arrivals:
    if kind in ("poisson", "constant"):
        if rate is None or rate <= 0:
            raise SplitserveError(f"{kind} arrivals need --rate > 0 (requests per second)")
        return Poisson(rate, seed) if kind == "poisson" else Constant(rate)
    if kind == "concurrency":
        if concurrency is None or concurrency < 1:
            raise SplitserveError("concurrency arrivals need --concurrency >= 1")
        return Concurrency(concurrency)
    if kind == "trace":
        return TraceSchedule()
    raise SplitserveError(f"unknown arrival process {kind!r}: poisson, constant, concurrency or trace")


def first_n(times: Iterator[float], n: int) -> list[float]:
    return list(itertools.islice(times, n))