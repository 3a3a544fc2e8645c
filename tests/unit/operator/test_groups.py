"""Worker groups from pods, and the per-pool plan: replace, scale, drain, roll."""

from __future__ import annotations

from splitserve.operator import names
from splitserve.operator.builders import Owner, build_group_pods, pool_spec_hash
from splitserve.operator.groups import observe_groups, plan_pool
from splitserve.services.spec.serving_deployment import ServingDeploymentSpec

OWNER = Owner("sd", "ns", "uid-1")
SPEC = ServingDeploymentSpec.from_dict({"model": {"source": "m"}, "decode": {"tensorParallel": 2}})
HASH = pool_spec_hash(SPEC, "decode")


def pods_of(group: str, created: str, *, node="n1", ready=True, phase="Running", spec=SPEC, draining=False):
    pods = build_group_pods(OWNER, spec, "decode", group)
    for pod in pods:
        pod["metadata"]["creationTimestamp"] = created
        pod["spec"]["nodeName"] = node
        pod["status"] = {"phase": phase, "conditions": [{"type": "Ready", "status": str(ready)}]}
        if draining:
            pod["metadata"]["labels"][names.LABEL_DRAINING] = "true"
    return pods


def groups(*pod_lists):
    return observe_groups([p for pods in pod_lists for p in pods]).get("decode", [])


def test_observe_groups_orders_oldest_first():
    observed = groups(pods_of("g2", "2026-01-02T00:00:00Z"), pods_of("g1", "2026-01-01T00:00:00Z"))
    assert [g.name for g in observed] == ["g1", "g2"]
    assert observed[0].size == 2 and observed[0].ready and observed[0].bound


def test_steady_state_does_nothing():
    plan = plan_pool(1, HASH, groups(pods_of("g1", "t1")), {"n1": True})
    assert (plan.num_create, plan.replace, plan.drain) == (0, [], [])


def test_scale_up_creates_groups():
    plan = plan_pool(3, HASH, groups(pods_of("g1", "t1")), {"n1": True})
    assert plan.num_create == 2


def test_failed_pod_or_not_ready_node_replaces_the_group():
    failed = pods_of("g1", "t1")
    failed[1]["status"]["phase"] = "Failed"
    plan = plan_pool(1, HASH, groups(failed), {"n1": True})
    assert plan.replace == [("g1", "pod g1-1 failed")] and plan.num_create == 0
    plan = plan_pool(1, HASH, groups(pods_of("g1", "t1")), {"n1": False})
    assert plan.replace == [("g1", "node n1 of pod g1-0 is NotReady")]
    missing = pods_of("g1", "t1")[:1]
    plan = plan_pool(1, HASH, groups(missing), {"n1": True})
    assert plan.replace == [("g1", "rank(s) 1 missing")]


def test_a_pod_being_deleted_replaces_its_group_gracefully_once():
    deleted = pods_of("g1", "t1")
    deleted[0]["metadata"]["deletionTimestamp"] = "t2"        # kubectl delete pod g1-0
    (group,) = groups(deleted)
    plan = plan_pool(1, HASH, [group], {"n1": True})
    assert plan.replace == [("g1", "pod g1-0 is being deleted")]
    assert group.leaves_gracefully({"n1": True}) and not group.leaving
    # Not gracefully when the group is dead anyway: a rank failed, or its node is gone.
    deleted[1]["status"]["phase"] = "Failed"
    assert not groups(deleted)[0].leaves_gracefully({"n1": True})
    assert not groups(pods_of("g2", "t1"))[0].leaves_gracefully({"n1": True})
    # Once every pod of it is being deleted, the group counts for nothing (no second replacement).
    for pod in deleted:
        pod["metadata"]["deletionTimestamp"] = "t3"
    plan = plan_pool(1, HASH, groups(deleted, pods_of("g2", "t4")), {"n1": True})
    assert (plan.num_create, plan.replace, plan.drain) == (0, [], [])


def test_scale_down_drains_not_ready_then_newest():
    observed = groups(pods_of("old", "t1"), pods_of("new", "t3"), pods_of("sick", "t2", ready=False))
    plan = plan_pool(2, HASH, observed, {"n1": True})
    assert plan.drain == [("sick", "ScaleDown")]
    plan = plan_pool(1, HASH, observed, {"n1": True})
    assert plan.drain == [("sick", "ScaleDown"), ("new", "ScaleDown")]


def test_draining_groups_are_not_counted_or_replaced():
    observed = groups(pods_of("g1", "t1"), pods_of("g2", "t2", draining=True, node="gone"))
    plan = plan_pool(1, HASH, observed, {"n1": True})
    assert (plan.num_create, plan.replace, plan.drain) == (0, [], [])


def test_rolling_update_surges_one_then_drains_one_stale():
    new_spec = ServingDeploymentSpec.from_dict({**SPEC.to_dict(), "image": "other:2"})
    new_hash = pool_spec_hash(new_spec, "decode")
    stale = [pods_of("a", "t1"), pods_of("b", "t2")]
    plan = plan_pool(2, new_hash, groups(*stale), {"n1": True})
    assert plan.num_create == 1 and plan.drain == []                     # surge
    fresh_starting = pods_of("c", "t3", spec=new_spec, ready=False)
    plan = plan_pool(2, new_hash, groups(*stale, fresh_starting), {"n1": True})
    assert (plan.num_create, plan.drain) == (0, [])                      # wait for it
    fresh = pods_of("c", "t3", spec=new_spec)
    plan = plan_pool(2, new_hash, groups(*stale, fresh), {"n1": True})
    assert plan.drain == [("a", "RollingUpdate")]                        # one at a time
    draining_a = pods_of("a", "t1", draining=True)
    plan = plan_pool(2, new_hash, groups(draining_a, stale[1], fresh), {"n1": True})
    assert plan.num_create == 1 and plan.drain == []                     # next surge
