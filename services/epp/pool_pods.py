"""The workers of an InferencePool, learned from its pods (Kubernetes).

The pool (`inference.networking.k8s.io/v1` InferencePool) names its pods by `selector.matchLabels`
and the port the gateway reaches them on by `targetPorts[0]`. Of the selected pods, those with the
`llm-d.ai/role` label are workers (`prefill`, `decode`, or `both`/`prefill-decode`: aggregated; a
splitserve frontend pod carries no such label and is left out); a Ready pod (its `Ready` condition
True, as Kubernetes' endpoints and GIE's own EPP count pods) with an IP that is not being deleted is
a member, at `<pod IP>:<its container port named grpc>` (the worker service; 50051 without one), and
a decode-capable member's gateway endpoint is `<pod IP>:<target port>`. Not merely Running: a pod
runs long before its worker listens (the model loads), and a worker dialled that early leaves its
gRPC channel in reconnect backoff (1 s growing by 1.6x, up to 120 s), so the picker would not
route to the pod until well after it is Ready; and a Ready pod's in-pod frontend (the endpoint)
is up too.

`PoolPods` is a registry for the frontend's `WorkerPool` (members() and `changed`): the pool
reconciles against it, then watches each member's gRPC health as for any worker. The Kubernetes
client is synchronous, so one thread lists and watches (kube_watch.py); each (re)list re-reads the InferencePool
(a changed selector or target port applies from the next watch window, at most `window_s`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from splitserve.discovery import WorkerRecord

from splitserve.services.epp.endpoints import EndpointBook
from splitserve.services.epp.kube_watch import WatchThread

log = logging.getLogger(__name__)

POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
ROLE_LABEL = "llm-d.ai/role"
ROLES = {"prefill": "prefill", "decode": "decode", "both": "both", "prefill-decode": "both"}
DEFAULT_WORKER_PORT = 50051
WINDOW_S = 60


@dataclass(slots=True, frozen=True)
class PodWorker:
    record: WorkerRecord
    endpoint: str


def pod_worker(pod: dict, target_port: int) -> PodWorker | None:
    """The worker a pod (the API's JSON form) is, or None when it is not one now."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    role = ROLES.get(((meta.get("labels") or {}).get(ROLE_LABEL) or "").strip())
    ip = status.get("podIP")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    if role is None or not ip or status.get("phase") != "Running" or not ready or meta.get("deletionTimestamp"):
        return None
    port = next((p.get("containerPort") for c in spec.get("containers") or [] for p in c.get("ports") or []
                 if p.get("name") == "grpc"), DEFAULT_WORKER_PORT)
    host = f"[{ip}]" if ":" in ip else ip
    return PodWorker(WorkerRecord(meta["name"], role, f"{host}:{port}"), f"{host}:{target_port}")


class PoolPods(WatchThread):
    def __init__(self, namespace: str, pool_name: str, endpoints: EndpointBook, window_s: int = WINDOW_S):
        super().__init__(window_s)
        self.namespace = namespace
        self.pool_name = pool_name
        self.endpoints = endpoints
        self.changed = asyncio.Event()
        self.synced = False               # the pods were listed at least once
        self._members: dict[str, PodWorker] = {}

    def members(self) -> dict[str, WorkerRecord]:
        return {name: w.record for name, w in self._members.items()}

    # -- the watching thread -------------------------------------------------------
    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        from kubernetes import client, watch

        core, custom = client.CoreV1Api(self._api), client.CustomObjectsApi(self._api)
        backoff = 0.5
        while not self._stop.is_set():
            try:
                pool = custom.get_namespaced_custom_object(POOL_GROUP, POOL_VERSION, self.namespace, POOL_PLURAL,
                                                           self.pool_name)
                selector = ",".join(f"{k}={v}" for k, v in sorted(pool["spec"]["selector"]["matchLabels"].items()))
                target_port = int(pool["spec"]["targetPorts"][0]["number"])
                listed = core.list_namespaced_pod(self.namespace, label_selector=selector, _preload_content=False)
                doc = json.loads(listed.data)
                pods = {p["metadata"]["name"]: p for p in doc.get("items") or []}
                loop.call_soon_threadsafe(self._replace, pods, target_port)
                version = doc["metadata"]["resourceVersion"]
                log.debug("epp: watching the pods %s from resourceVersion %s", selector, version)
                stream = watch.Watch().stream(core.list_namespaced_pod, self.namespace, label_selector=selector,
                                              resource_version=version, timeout_seconds=self.window_s,
                                              _preload_content=False)
                events = 0
                for event in stream:
                    if self._stop.is_set():
                        return
                    events += 1
                    raw = event.get("raw_object") or {}
                    log.debug("epp: pod event %s %s", event.get("type"), (raw.get("metadata") or {}).get("name"))
                    if event.get("type") in ("ADDED", "MODIFIED", "DELETED") and raw.get("metadata"):
                        loop.call_soon_threadsafe(self._apply, event["type"], raw, target_port)
                log.debug("epp: the pods' watch window ended after %d events", events)
                backoff = 0.5
            except Exception as exc:  # noqa: BLE001 - the apiserver away or the pool missing: retry
                log.warning("epp: reading InferencePool %s/%s and its pods failed (%s); retrying in %.1f s",
                            self.namespace, self.pool_name, str(exc).splitlines()[0][:200], backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    # -- on the event loop -----------------------------------------------------------
    def _replace(self, pods: dict[str, dict], target_port: int) -> None:
        for name in [n for n in self._members if n not in pods]:
            self._drop(name, "no longer listed")
        for pod in pods.values():
            self._apply("MODIFIED", pod, target_port)
        if not self.synced:
            log.info("epp: InferencePool %s/%s selects %d pods; %d are Ready workers", self.namespace,
                     self.pool_name, len(pods), len(self._members))
        self.synced = True
        self.changed.set()

    def _apply(self, kind: str, pod: dict, target_port: int) -> None:
        name = pod["metadata"]["name"]
        worker = None if kind == "DELETED" else pod_worker(pod, target_port)
        if worker is None:
            if name in self._members:
                self._drop(name, "deleted" if kind == "DELETED" else "not a Ready worker now")
                self.changed.set()
            return
        if self._members.get(name) != worker:
            old = self._members.get(name)
            if old is not None:
                self.endpoints.forget(old.record.address)
            self._members[name] = worker
            self.endpoints.set(worker.record.address, worker.endpoint)
            log.info("epp: pod %s joins the pool: %s worker at %s, endpoint %s", name, worker.record.role,
                     worker.record.address, worker.endpoint)
            self.changed.set()

    def _drop(self, name: str, why: str) -> None:
        worker = self._members.pop(name)
        self.endpoints.forget(worker.record.address)
        log.info("epp: pod %s leaves the pool (%s): worker %s", name, why, worker.record.address)
