"""Helpers of the operator tests: the operator as a local process, a real worker
standing for a pod, and bounded waits on ServingDeployment state.

The operator runs as `splitserve operator` against the test apiserver (kwok runs
no containers, so the chart's operator Deployment never does anything), with
`--worker-address annotation`: pods on simulated nodes have fake IPs that must
never be dialled; a test points a pod at a real `splitserve worker` on
127.0.0.1 with the `splitserve.io/worker-address` annotation.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster import wait_until
from procs import Component

from splitserve.net import free_port

GROUP = "splitserve.io"
VERSION = "v1alpha1"


@dataclass
class OperatorProcess:
    component: Component

    @classmethod
    def start(cls, kubeconfig: Path, namespace: str, log_path: Path) -> OperatorProcess:
        splitserve = shutil.which("splitserve")
        assert splitserve, "the splitserve console script is not installed"
        component = Component("operator", [splitserve, "--log-level", "INFO", "operator",
                                           "--kubeconfig", str(kubeconfig), "--namespace", namespace,
                                           "--interval", "0.5", "--worker-address", "annotation", "--node-grace", "4",
                                           "--etcd-endpoint", "127.0.0.1:1",
                                           "--leader-election-namespace", namespace], log_path)
        component.start(env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return cls(component)

    def log(self) -> str:
        return self.component.log_tail(20000)

    def stop(self) -> int:
        popen = self.component.popen
        if popen.poll() is None:
            popen.terminate()
            try:
                popen.wait(20)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
                raise AssertionError(f"operator did not stop on SIGTERM:\n{self.log()}")
        return popen.returncode


@dataclass
class Worker:
    """A real `splitserve worker` on 127.0.0.1 (standing for a pod kwok cannot run)."""

    popen: subprocess.Popen
    address: str
    lines: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, model_dir: Path, timeout: float = 120.0) -> Worker:
        port = free_port()
        popen = subprocess.Popen(
            ["splitserve", "worker", "--model", str(model_dir), "--port", str(port), "--threads", "1",
             "--kv-cache-gib", "0.05", "--worker-id", "k8s-standin"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        worker = cls(popen, f"127.0.0.1:{port}")
        threading.Thread(target=lambda: [worker.lines.append(l.rstrip()) for l in popen.stdout],
                         daemon=True).start()
        try:
            wait_until(lambda: any(" ready " in l for l in worker.lines) or popen.poll() is not None,
                       timeout=timeout, what="the worker to be ready")
            assert popen.poll() is None, "\n".join(worker.lines)
        except BaseException:
            worker.stop()
            raise
        return worker

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


class Api:
    """JSON reads through kubectl-equivalent REST calls of the official client."""

    def __init__(self, cluster, namespace: str):
        from kubernetes import client

        self.cluster = cluster
        self.namespace = namespace
        self.core = client.CoreV1Api(cluster.api_client())
        self.custom = client.CustomObjectsApi(cluster.api_client())
        self.apps = client.AppsV1Api(cluster.api_client())

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.cluster.kubectl("-n", self.namespace, *args, "-o", "json").stdout)

    def sd(self, name: str) -> dict[str, Any]:
        return self.kubectl_json("get", "servingdeployment", name)

    def pods(self, name: str, pool: str | None = None) -> list[dict[str, Any]]:
        selector = f"splitserve.io/deployment={name},splitserve.io/group"
        if pool:
            selector += f",splitserve.io/pool={pool}"
        return self.kubectl_json("get", "pods", "-l", selector)["items"]

    def groups(self, name: str, pool: str) -> dict[str, list[dict[str, Any]]]:
        found: dict[str, list[dict[str, Any]]] = {}
        for pod in self.pods(name, pool):
            found.setdefault(pod["metadata"]["labels"]["splitserve.io/group"], []).append(pod)
        return found

    def events(self, name: str) -> list[dict[str, Any]]:
        items = self.kubectl_json("get", "events", "--field-selector",
                                  f"involvedObject.kind=ServingDeployment,involvedObject.name={name}")["items"]
        # Timestamps have one-second resolution; the operator posts its events one after
        # another, so the order of their resourceVersions (etcd revisions) is the order of the steps.
        return sorted(items, key=lambda e: int(e["metadata"]["resourceVersion"]))

    def event_messages(self, name: str, reason: str) -> list[str]:
        return [e["message"] for e in self.events(name) if e["reason"] == reason]

    def apply(self, doc: dict[str, Any], check: bool = True) -> subprocess.CompletedProcess:
        return self.cluster.kubectl("-n", self.namespace, "apply", "-f", "-", input=json.dumps(doc), check=check)


def sd_doc(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ServingDeployment", "metadata": {"name": name},
            "spec": spec}


def pool_status(sd: dict[str, Any], pool: str) -> dict[str, Any]:
    return (sd.get("status") or {}).get(pool) or {}


def condition(sd: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in (sd.get("status") or {}).get("conditions", []) if c["type"] == kind), {})


def nodes_of(pods: list[dict[str, Any]]) -> list[str | None]:
    return [p["spec"].get("nodeName") for p in sorted(pods, key=lambda p: p["metadata"]["name"])]


def group_phase(sd: dict[str, Any], pool: str, group: str) -> str | None:
    return next((g["phase"] for g in pool_status(sd, pool).get("groups", []) if g["name"] == group), None)


def schema_message(stderr: str) -> str:
    return re.sub(r"\s+", " ", stderr)
