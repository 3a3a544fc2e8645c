"""Status: group phases and the Ready / Progressing / Degraded conditions."""

from __future__ import annotations

from splitserve.operator.groups import Group, PodState
from splitserve.operator.status import Observed, build_status, pool_status


def group(name, *, bound=True, ready=True, draining=False, drain_state="", deleting=False):
    annotations = {"splitserve.io/drain-state": drain_state} if drain_state else {}
    pods = [PodState(f"{name}-{r}", r, "n1" if bound else None, "Running", ready, deleting, annotations, None)
            for r in range(2)]
    return Group(name, "decode", 2, "h", "t", draining, pods)


def test_group_phases():
    pool = pool_status(3, [group("a"), group("b", bound=False), group("c", ready=False),
                           group("d", draining=True), group("e", draining=True, drain_state="drained"),
                           group("f", draining=True, deleting=True)], {"b": "no node has 4 free nvidia.com/gpu"})
    assert [(g.name, g.phase) for g in pool.groups] == [
        ("a", "Ready"), ("b", "Pending"), ("c", "Starting"), ("d", "Draining"), ("e", "Drained"), ("f", "Deleting")]
    assert pool.groups[1].reason == "no node has 4 free nvidia.com/gpu"
    assert (pool.ready, pool.desired) == (1, 3)


def test_conditions_and_transition_times():
    ready = Observed(4, {"decode": pool_status(1, [group("a")], {})}, 1, 1)
    status = build_status(ready, {}, "T1")
    by_type = {c["type"]: c for c in status["conditions"]}
    assert by_type["Ready"]["status"] == "True" and by_type["Degraded"]["status"] == "False"
    assert status["observedGeneration"] == 4 and status["decode"]["current"] == 1
    again = build_status(ready, status, "T2")          # unchanged: the transition time stays
    assert {c["type"]: c["lastTransitionTime"] for c in again["conditions"]}["Ready"] == "T1"
    pending = Observed(5, {"decode": pool_status(1, [group("b", bound=False)], {"b": "no room"})}, 1, 1)
    by_type = {c["type"]: c for c in build_status(pending, status, "T3")["conditions"]}
    assert by_type["Ready"]["status"] == "False" and by_type["Ready"]["lastTransitionTime"] == "T3"
    assert by_type["Degraded"]["reason"] == "Unschedulable" and "b: no room" in by_type["Degraded"]["message"]
    invalid = build_status(Observed(6, {}, 0, 0, spec_error="spec.model: required"), {}, "T4")
    assert {c["type"]: c["reason"] for c in invalid["conditions"]}["Degraded"] == "InvalidSpec"
