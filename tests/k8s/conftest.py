"""Fixtures for tests on the real Kubernetes control plane (DESIGN section 6).

`kube_cluster` (session-scoped) starts etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok once for the whole session and
stops them at its end; `k8s_namespace` gives each test a fresh namespace and
deletes it afterwards; `node_agent` gives a test a node whose pods really run
(node_agent.py, the stand-in for kubelet + container runtime). The binaries come from tests/k8s/build-control-plane.sh
(see tests/k8s/README.md). Without them the tests skip on a developer machine
and fail under CI=true.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import pytest

# The helpers beside this file are plain modules (tests are not a package, and
# --import-mode=importlib keeps tests/ off sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from controlplane import KubeCluster, MissingBinariesError, locate_bin_dir, start_cluster  # noqa: E402
from node_agent import NodeAgent  # noqa: E402
from node_agent_workloads import next_pod_cidr  # noqa: E402


@pytest.fixture(scope="session")
def k8s_bin_dir() -> Path:
    """The build cache's bin/ (kubectl, helm, kwok, kube-*)."""
    try:
        return locate_bin_dir()
    except MissingBinariesError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"Kubernetes control plane not built: {e}")
        pytest.skip(f"Kubernetes control plane not built: {e}")


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory: pytest.TempPathFactory, k8s_bin_dir: Path) -> KubeCluster:
    cluster = start_cluster(tmp_path_factory.mktemp("kube"), bin_dir=k8s_bin_dir)
    print(f"\n[kube_cluster] control plane up in {cluster.startup_seconds:.1f} s at {cluster.server}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def k8s_namespace(kube_cluster: KubeCluster) -> str:
    name = kube_cluster.create_namespace()
    try:
        yield name
    finally:
        kube_cluster.delete_namespace(name)


@pytest.fixture
def node_agent(kube_cluster: KubeCluster, tmp_path: Path) -> NodeAgent:
    """A Ready node run by the test node agent (2 GPUs, tainted AGENT_TAINT): its pods really run."""
    agent = NodeAgent(kube_cluster.api_client(), f"agent-{secrets.token_hex(3)}", tmp_path / "agent", gpus=2,
                      pod_cidr=next_pod_cidr()).start()
    try:
        kube_cluster.wait_node_ready(agent.node_name, True, timeout=30)
        yield agent
        assert not agent.errors, "\n".join(agent.errors)
    finally:
        agent.stop()
        kube_cluster.delete_node(agent.node_name)
