"""`KubeCluster`: the handle tests get on the running test control plane.

It wraps the real tools — kubectl, helm and the official `kubernetes` Python
client — with the cluster's kubeconfig, and adds the few cluster-admin chores
tests need: simulated GPU nodes (nodes.py), NotReady nodes, fresh namespaces.
Every wait is bounded (`wait_until`, splitserve.testing.waiting, which the k8s modules
import from here) and raises a TimeoutError saying what it waited for.
"""

from __future__ import annotations

import datetime as dt
import itertools
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodes import KWOK_MANAGED, KWOK_MANAGED_VALUE, build_gpu_node, not_ready_condition
from procs import Component

from splitserve.testing.waiting import wait_until

NOT_READY_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
_namespace_counter = itertools.count(1)


def _node_ready_status(node: Any) -> str | None:
    for cond in (node.status.conditions or []) if node.status else []:
        if cond.type == "Ready":
            return cond.status
    return None


def _taint_keys(node: Any) -> set[str]:
    return {t.key for t in (node.spec.taints or [])}


@dataclass(slots=True)
class KubeCluster:
    """A running control plane: etcd, kube-apiserver, controller-manager, scheduler, kwok."""

    kubeconfig: Path
    server: str              # https://127.0.0.1:<port>
    bin_dir: Path            # kubectl, helm, kwok, kube-* (the build cache)
    workdir: Path            # logs, certificates, helm's home
    token: str               # admin bearer token (group system:masters)
    ca_cert: Path
    components: list[Component] = field(repr=False)
    scratch_dirs: list[Path] = field(default_factory=list, repr=False)
    startup_seconds: float = 0.0

    # ---- clients -----------------------------------------------------------------

    def api_client(self):
        """A new `kubernetes.client.ApiClient` authenticated as the cluster admin."""
        from kubernetes import client

        config = client.Configuration()
        config.host = self.server
        config.ssl_ca_cert = str(self.ca_cert)
        config.api_key = {"authorization": self.token}
        config.api_key_prefix = {"authorization": "Bearer"}
        return client.ApiClient(config)

    def core(self):
        """A CoreV1Api on a fresh ApiClient."""
        from kubernetes import client

        return client.CoreV1Api(self.api_client())

    def _run(self, argv: list[str], *, check: bool, input: str | None, timeout: float,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=timeout,
                              env=env, stdin=None if input is not None else subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, argv, proc.stdout, proc.stderr)
        return proc

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run the real kubectl against this cluster; raises CalledProcessError when check fails."""
        return self._run([str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
                         check=check, input=input, timeout=timeout)

    def helm_env(self) -> dict[str, str]:
        """helm's environment: this kubeconfig, and helm homes inside the work folder."""
        home = self.workdir / "helm"
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig),
                "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
                "HELM_DATA_HOME": str(home / "data")}

    def helm(self, *args: str, check: bool = True, input: str | None = None,
             timeout: float = 120.0) -> subprocess.CompletedProcess:
        """Run the real helm against this cluster."""
        return self._run([str(self.bin_dir / "helm"), *args], check=check, input=input,
                         timeout=timeout, env=self.helm_env())

    # ---- namespaces --------------------------------------------------------------

    def wait_for_service_account(self, namespace: str, name: str = "default", timeout: float = 30.0) -> None:
        from kubernetes.client.exceptions import ApiException

        core = self.core()

        def exists() -> bool:
            try:
                core.read_namespaced_service_account(name, namespace)
                return True
            except ApiException as e:
                if e.status == 404:
                    return False
                raise

        wait_until(exists, timeout=timeout, what=f"ServiceAccount {namespace}/{name}")

    def create_namespace(self, prefix: str = "t") -> str:
        """A fresh namespace (unique name), ready for pods (its default ServiceAccount exists)."""
        name = f"{prefix}-{next(_namespace_counter)}-{secrets.token_hex(3)}"
        self.core().create_namespace({"metadata": {"name": name, "labels": {"splitserve.io/test": "true"}}})
        self.wait_for_service_account(name)
        return name

    def delete_namespace(self, name: str) -> None:
        """Start deleting a namespace (the namespace controller finishes it in the background)."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.core().delete_namespace(name)
        except ApiException as e:
            if e.status != 404:
                raise

    # ---- nodes -------------------------------------------------------------------

    def add_gpu_node(self, name: str, gpus: int = 8, labels: dict[str, str] | None = None, *,
                     wait_ready: bool = True, timeout: float = 30.0, **resources: Any):
        """Create a kwok-managed node with `gpus` nvidia.com/gpu; wait until it is Ready.

        Extra keyword arguments go to nodes.build_gpu_node (cpu, memory, pods, zone, region).
        """
        core = self.core()
        core.create_node(build_gpu_node(name, gpus=gpus, labels=labels, **resources))
        if wait_ready:
            return self.wait_node_ready(name, True, timeout=timeout)
        return core.read_node(name)

    def delete_node(self, name: str, *, wait: bool = True, timeout: float = 30.0) -> None:
        from kubernetes.client.exceptions import ApiException

        core = self.core()
        try:
            core.delete_node(name)
        except ApiException as e:
            if e.status != 404:
                raise
        if wait:
            def gone() -> bool:
                try:
                    core.read_node(name)
                    return False
                except ApiException as e:
                    return e.status == 404
            wait_until(gone, timeout=timeout, what=f"node {name} to be deleted")

    def set_node_ready(self, name: str, ready: bool, *, timeout: float = 60.0):
        """Make a node NotReady (its simulated kubelet dies) or Ready again.

        NotReady: kwok stops managing the node (annotation removed: no more lease
        renewals or status heartbeats) and the node reports Ready=False; returns
        once the node lifecycle controller has tainted it not-ready/unreachable,
        i.e. once Kubernetes itself treats the node as NotReady. Ready: kwok
        manages it again; returns once Ready=True and those taints are gone.
        """
        core = self.core()
        if ready:
            core.patch_node(name, {"metadata": {"annotations": {KWOK_MANAGED: KWOK_MANAGED_VALUE}}})
            return self.wait_node_ready(name, True, timeout=timeout)
        core.patch_node(name, {"metadata": {"annotations": {KWOK_MANAGED: None}}})
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        core.patch_node_status(name, {"status": {"conditions": [not_ready_condition(now)]}})
        return self.wait_node_ready(name, False, timeout=timeout)

    def wait_node_ready(self, name: str, ready: bool, *, timeout: float = 30.0):
        """Wait until the node is Ready and untainted, or NotReady as the controller sees it."""
        core = self.core()

        def check():
            node = core.read_node(name)
            status, taints = _node_ready_status(node), _taint_keys(node)
            if ready:
                ok = status == "True" and not taints.intersection(NOT_READY_TAINTS)
            else:
                ok = status in ("False", "Unknown") and bool(taints.intersection(NOT_READY_TAINTS))
            return node if ok else None

        return wait_until(check, timeout=timeout, what=f"node {name} to be {'Ready' if ready else 'NotReady'}")

    # ---- lifecycle ---------------------------------------------------------------

    def stop(self) -> None:
        """Stop every component (reverse start order) and remove etcd's data."""
        for c in reversed(self.components):
            c.stop()
        for d in self.scratch_dirs:
            shutil.rmtree(d, ignore_errors=True)
