"""Arrival processes: seeded Poisson, constant spacing, the trace's own schedule."""

from __future__ import annotations

import pytest

from splitserve.errors import SplitserveError
from splitserve.loadgen.arrivals import Concurrency, Constant, Poisson, TraceSchedule, make_arrivals
from splitserve.loadgen.workloads import Conversation


def convs(n, arrivals=None):
    return [Conversation(str(i), [], arrival_s=None if arrivals is None else arrivals[i]) for i in range(n)]


def test_poisson_is_seeded_with_the_right_mean_gap():
    times = [t for t, _ in Poisson(4.0, seed=1).schedule(convs(4000))]
    assert times == [t for t, _ in Poisson(4.0, seed=1).schedule(convs(4000))]
    assert times != [t for t, _ in Poisson(4.0, seed=2).schedule(convs(4000))]
    assert times[0] == 0.0 and all(b > a for a, b in zip(times, times[1:]))
    assert times[-1] / (len(times) - 1) == pytest.approx(0.25, rel=0.05)


def test_constant_and_trace_schedules():
    assert [t for t, _ in Constant(5.0).schedule(convs(4))] == pytest.approx([0, 0.2, 0.4, 0.6])
    pairs = list(TraceSchedule().schedule(convs(3, [0.0, 1.5, 1.5])))
    assert [t for t, _ in pairs] == [0.0, 1.5, 1.5] and [c.conversation_id for _, c in pairs] == ["0", "1", "2"]
    with pytest.raises(SplitserveError, match="timestamps"):
        list(TraceSchedule().schedule(convs(1)))
    assert Concurrency(3).schedule(convs(3)) is None


def test_make_arrivals_checks_its_arguments():
    assert make_arrivals("poisson", rate=2.0) == Poisson(2.0, 0)
    assert make_arrivals("constant", rate=2.0).with_rate(3.0) == Constant(3.0)
    assert make_arrivals("concurrency", concurrency=2) == Concurrency(2)
    for kind, kw in (("poisson", {}), ("constant", {"rate": 0}), ("concurrency", {"concurrency": 0}), ("x", {})):
        with pytest.raises(SplitserveError):
            make_arrivals(kind, **kw)
