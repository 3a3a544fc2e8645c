"""InferenceObjectives: the priority that a request's objective header names.

A client (or the gateway's policy on its behalf) names an objective in the header
`x-gateway-inference-objective` (llm-d's endpoint picker; `x-llm-d-inference-objective` is read
too); the objective is an `InferenceObjective` (`inference.networking.x-k8s.io/v1alpha2`, the API
llm-d's inference scheduler carries since GIE v1.6.0 dropped it) in the pool's namespace whose
`spec.poolRef.name` is the pool. Its `spec.priority` (higher is more critical; unset is 0; negative
allowed) orders the request in flow control. splitserve's priority is vLLM's (lower goes first), so
an objective of priority P gives the request priority -P, and it overrides the body's `priority`:
the objective is the platform's word, the body the client's. A name no objective has leaves the
body's priority (llm-d: the default objective), and is counted.

Objectives come from `--objective NAME=PRIORITY` flags (outside Kubernetes) and, with
`--pool-name`, from the cluster (a watch; a cluster's objective wins over a flag of the same
name). A cluster without the CRD is logged once and looked at again every window.
"""

from __future__ import annotations

import asyncio
import json
import logging

from splitserve.errors import SplitserveError
from splitserve.services.flow_control import OBJECTIVE_HEADER

from splitserve.services.epp.kube_watch import WatchThread

log = logging.getLogger(__name__)

OBJECTIVE_HEADERS = ("x-gateway-inference-objective", OBJECTIVE_HEADER)
OBJECTIVE_GROUP, OBJECTIVE_VERSION = "inference.networking.x-k8s.io", "v1alpha2"
OBJECTIVE_PLURAL = "inferenceobjectives"
WINDOW_S = 60


def parse_objective_flag(text: str) -> tuple[str, int]:
    """`NAME=PRIORITY` (an --objective flag) as (name, priority in the objective's sense)."""
    name, sep, value = text.partition("=")
    try:
        priority = int(value)
    except ValueError:
        priority = None
    if not sep or not name.strip() or priority is None:
        raise SplitserveError(f"--objective takes NAME=PRIORITY (an integer; higher is more critical), not {text!r}")
    return name.strip(), priority


def objective_entry(doc: dict, pool_name: str) -> tuple[str, int] | None:
    """(name, priority) of an InferenceObjective (the API's JSON form) of this pool, else None."""
    meta, spec = doc.get("metadata") or {}, doc.get("spec") or {}
    if (spec.get("poolRef") or {}).get("name") != pool_name or not meta.get("name"):
        return None
    priority = spec.get("priority")
    return meta["name"], int(priority) if isinstance(priority, int) else 0


class ObjectiveBook:
    """Objective name → priority; `priority_of` a request's headers in splitserve's sense."""

    def __init__(self, static: dict[str, int] | None = None):
        self._static = dict(static or {})
        self._watched: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self._static or self._watched)

    def named(self, headers: dict[str, str]) -> str:
        return next((headers[h].strip() for h in OBJECTIVE_HEADERS if headers.get(h, "").strip()), "")

    def priority_of(self, name: str) -> int | None:
        """The request priority (vLLM's sense: lower first) of objective `name`, None if unknown."""
        priority = self._watched.get(name, self._static.get(name))
        return None if priority is None else -priority

    def replace_watched(self, entries: dict[str, int]) -> None:
        self._watched = dict(entries)

    def set_watched(self, name: str, priority: int | None) -> None:
        if priority is None:
            self._watched.pop(name, None)
        else:
            self._watched[name] = priority


class ObjectiveWatch(WatchThread):
    """Keeps an ObjectiveBook's cluster part equal to the pool's InferenceObjectives (one thread:
    the Kubernetes client is synchronous), as `PoolPods` does for the pods."""

    def __init__(self, book: ObjectiveBook, namespace: str, pool_name: str, window_s: int = WINDOW_S,
                 api_client=None):
        super().__init__(window_s, api_client)
        self.book = book
        self.namespace = namespace
        self.pool_name = pool_name

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        from kubernetes import client, watch
        from kubernetes.client.exceptions import ApiException

        custom = client.CustomObjectsApi(self._api)
        args = (OBJECTIVE_GROUP, OBJECTIVE_VERSION, self.namespace, OBJECTIVE_PLURAL)
        told_missing, backoff = False, 0.5
        while not self._stop.is_set():
            try:
                doc = json.loads(custom.list_namespaced_custom_object(*args, _preload_content=False).data)
                entries = dict(e for e in (objective_entry(o, self.pool_name) for o in doc.get("items") or []) if e)
                loop.call_soon_threadsafe(self.book.replace_watched, entries)
                told_missing, backoff = False, 0.5
                stream = watch.Watch().stream(custom.list_namespaced_custom_object, *args,
                                              resource_version=doc["metadata"]["resourceVersion"],
                                              timeout_seconds=self.window_s, _preload_content=False)
                for event in stream:
                    if self._stop.is_set():
                        return
                    raw = event.get("raw_object") or {}
                    name = (raw.get("metadata") or {}).get("name")
                    if name and event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        entry = None if event["type"] == "DELETED" else objective_entry(raw, self.pool_name)
                        loop.call_soon_threadsafe(self.book.set_watched, name, entry[1] if entry else None)
            except ApiException as exc:
                if exc.status == 404:     # no InferenceObjective CRD in this cluster
                    if not told_missing:
                        log.info("epp: no InferenceObjective API (%s/%s) in the cluster; objective headers "
                                 "resolve from --objective only; looking again every %d s", OBJECTIVE_GROUP,
                                 OBJECTIVE_VERSION, self.window_s)
                        told_missing = True
                    self._stop.wait(self.window_s)
                    continue
                self._retry(exc, backoff)
                backoff = min(backoff * 2, 10.0)
            except Exception as exc:  # noqa: BLE001 - the apiserver away: retry
                self._retry(exc, backoff)
                backoff = min(backoff * 2, 10.0)

    def _retry(self, exc: Exception, backoff: float) -> None:
        log.warning("epp: reading InferenceObjectives in %s failed (%s); retrying in %.1f s", self.namespace,
                    str(exc).splitlines()[0][:200], backoff)
        self._stop.wait(backoff)
