"""Gang placement: all-or-nothing, capacity, topology, decode before prefill (with properties)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.operator.placement import GroupRequest, NodeInfo, place_groups

ZONE = "topology.kubernetes.io/zone"


def node(name, gpus, zone="a", schedulable=True):
    return NodeInfo(name, gpus, {ZONE: zone}, schedulable)


def test_same_node_best_fit_and_reason():
    nodes = [node("n1", 8), node("n2", 4)]
    result = place_groups([GroupRequest("ns/g", "decode", 2, 2)], nodes)
    assert result.assignments == {"ns/g": ["n2", "n2"]}      # best fit leaves n1 whole
    result = place_groups([GroupRequest("ns/big", "decode", 3, 4)], nodes)
    assert result.assignments == {}
    assert "no node has 12 free nvidia.com/gpu" in result.reasons["ns/big"]
    assert "most free: 8 on n1" in result.reasons["ns/big"]


def test_decode_is_placed_before_prefill():
    nodes = [node("n1", 4)]
    requests = [GroupRequest("ns/p", "prefill", 1, 4), GroupRequest("ns/d", "decode", 1, 4)]
    result = place_groups(requests, nodes)
    assert result.assignments == {"ns/d": ["n1"]}
    assert "ns/p" in result.reasons


def test_same_label_keeps_a_group_in_one_zone():
    nodes = [node("a1", 2, "a"), node("b1", 2, "b"), node("b2", 2, "b")]
    request = GroupRequest("ns/g", "decode", 4, 1, "same-label", ZONE)
    result = place_groups([request], nodes)
    assert sorted(result.assignments["ns/g"]) == ["b1", "b1", "b2", "b2"]
    result = place_groups([GroupRequest("ns/g", "decode", 5, 1, "same-label", ZONE)], nodes)
    assert "the best domain, topology.kubernetes.io/zone=b, fits 4" in result.reasons["ns/g"]


def test_unschedulable_nodes_take_nothing():
    result = place_groups([GroupRequest("ns/g", "decode", 1, 1)], [node("n1", 8, schedulable=False)])
    assert "no schedulable node" in result.reasons["ns/g"]


def test_cpu_only_groups_need_no_gpu():
    result = place_groups([GroupRequest("ns/g", "decode", 2, 0, "none")], [node("n1", 0)])
    assert result.assignments["ns/g"] == ["n1", "n1"]


nodes_strategy = st.lists(st.tuples(st.integers(0, 8), st.sampled_from("abc"), st.booleans()),
                          min_size=0, max_size=6)
requests_strategy = st.lists(st.tuples(st.sampled_from(["prefill", "decode"]), st.integers(1, 4),
                                       st.integers(0, 4), st.sampled_from(["same-node", "same-label", "none"])),
                             min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(nodes_strategy, requests_strategy)
def test_placement_properties(raw_nodes, raw_requests):
    nodes = [node(f"n{i}", gpus, zone, ok) for i, (gpus, zone, ok) in enumerate(raw_nodes)]
    requests = [GroupRequest(f"ns/g{i}", pool, pods, gpus, topo, ZONE if topo == "same-label" else None)
                for i, (pool, pods, gpus, topo) in enumerate(raw_requests)]
    result = place_groups(requests, nodes)
    by_name = {n.name: n for n in nodes}
    # Every group is either placed whole or waits with a reason; never both.
    assert set(result.assignments) | set(result.reasons) == {r.key for r in requests}
    assert not set(result.assignments) & set(result.reasons)
    used: Counter[str] = Counter()
    for request in requests:
        placed = result.assignments.get(request.key)
        if placed is None:
            assert result.reasons[request.key]
            continue
        assert len(placed) == request.num_pods
        assert all(by_name[n].schedulable for n in placed)
        if request.topology == "same-node":
            assert len(set(placed)) == 1
        if request.topology == "same-label":
            assert len({by_name[n].labels[ZONE] for n in placed}) == 1
        for name in placed:
            used[name] += request.gpus_per_pod
    # No node is given more GPUs than it has free.
    assert all(used[name] <= by_name[name].free_gpus for name in used)
    # Decode first: a lone decode group that fits the cluster on its own is placed,
    # whatever prefill groups were listed before it.
    decodes = [r for r in requests if r.pool == "decode"]
    if len(decodes) == 1 and place_groups(decodes, nodes).assignments:
        assert decodes[0].key in result.assignments
