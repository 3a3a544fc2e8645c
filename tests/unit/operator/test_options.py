"""`splitserve operator`'s options: flags first, then the chart's SPLITSERVE_* environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.errors import SplitserveError
from splitserve.operator.runner import OperatorOptions

FLAGS = dict(kubeconfig=None, namespaces=None, all_namespaces=False, etcd_endpoint=None, interval_s=2.0,
             worker_address="auto", node_grace_s=10.0, leader_election_namespace=None, health_port=None)


def _options(environ: dict[str, str], **flags) -> OperatorOptions:
    return OperatorOptions.from_flags(**{**FLAGS, **flags}, environ=environ)


def test_the_charts_environment_stands_in_for_missing_flags():
    options = _options({"SPLITSERVE_WATCH_NAMESPACES": "a,,b", "SPLITSERVE_ETCD": "http://etcd-0:2379,etcd-1:2379",
                        "SPLITSERVE_HEALTH_PORT": "8080", "SPLITSERVE_LEADER_ELECTION_NAMESPACE": "ops",
                        "SPLITSERVE_ETCD_TLS_SECRET": "etcd-client"})
    assert options.namespaces == ["a", "b"]
    assert options.etcd_endpoints == ["etcd-0:2379", "etcd-1:2379"]     # every member, schemes dropped
    assert options.health_port == 8080
    assert options.leader_election_namespace == "ops"
    assert options.etcd_tls_secret == "etcd-client"


def test_flags_win_over_the_environment():
    env = {"SPLITSERVE_WATCH_NAMESPACES": "a", "SPLITSERVE_ETCD": "e:1", "SPLITSERVE_HEALTH_PORT": "1",
           "SPLITSERVE_LEADER_ELECTION_NAMESPACE": "x"}
    options = _options(env, namespaces=["n"], etcd_endpoint="f:2", health_port=9, leader_election_namespace="y",
                       kubeconfig="/k", worker_address="annotation")
    assert (options.namespaces, options.etcd_endpoints, options.health_port) == (["n"], ["f:2"], 9)
    assert options.leader_election_namespace == "y"
    assert options.kubeconfig == Path("/k") and options.use_pod_ip is False
    assert _options(env, all_namespaces=True).namespaces == []       # every namespace


def test_defaults_and_the_missing_scope():
    options = _options({"SPLITSERVE_WATCH_NAMESPACES": ""})             # set but empty: all namespaces
    assert options.namespaces == [] and options.etcd_endpoints == ["splitserve-etcd:2379"]
    assert options.health_port is None and options.leader_election_namespace is None
    assert options.etcd_tls_secret is None
    with pytest.raises(SplitserveError, match="--namespace"):
        _options({})

