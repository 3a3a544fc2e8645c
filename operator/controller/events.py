"""Kubernetes Events on a ServingDeployment: one per reconcile step (`kubectl describe sd` shows them).

`record` posts a new Event each time; `record_series` is for what repeats every interval (the
autoscaler's decisions): while the `key` of a reason on an object stays the same it bumps the
last Event's count, lastTimestamp and message instead of posting another (client-go's
recorder aggregates repeats the same way), and a new key starts a new Event.
"""

from __future__ import annotations

import datetime as dt
import logging
import socket
from dataclasses import dataclass
from typing import Any

from splitserve.operator.builders import Owner
from splitserve.operator.kube import AsyncKube, KubeError, core_path
from splitserve.services.spec.serving_deployment import API_GROUP, API_VERSION, KIND

log = logging.getLogger(__name__)
COMPONENT = "splitserve-operator"


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(slots=True)
class _Series:
    key: str
    name: str          # the Event's metadata.name
    count: int


class EventRecorder:
    def __init__(self, kube: AsyncKube):
        self.kube = kube
        self.instance = socket.gethostname()
        self._series: dict[tuple[str, str], _Series] = {}     # (owner uid, reason) -> its last Event

    def forget(self, uid: str) -> None:
        """Drop the series kept for an object (deleted, or no longer repeating)."""
        for slot in [s for s in self._series if s[0] == uid]:
            del self._series[slot]

    async def record(self, owner: Owner, reason: str, message: str, warning: bool = False) -> None:
        """Post one Event; a failure to post is logged, never raised (events are best effort)."""
        (log.warning if warning else log.info)("%s/%s: %s: %s", owner.namespace, owner.name, reason, message)
        await self._post(owner, reason, message, warning)

    async def record_series(self, owner: Owner, reason: str, message: str, key: str, warning: bool = False) -> None:
        """Post an Event, or bump the last one of this reason on `owner` while `key` is unchanged
        (module header). Not logged here: the caller logs what it decided. Best effort."""
        slot = (owner.uid, reason)
        last = self._series.get(slot)
        if last is not None and last.key == key:
            try:
                await self.kube.merge_patch(core_path(owner.namespace, "events", last.name),
                                            {"count": last.count + 1, "lastTimestamp": now_iso(), "message": message})
                last.count += 1
                return
            except KubeError as exc:
                if not exc.not_found:     # gone (expired): post a new one
                    log.warning("could not update event %s on %s/%s: %s", reason, owner.namespace, owner.name, exc)
                    return
        created = await self._post(owner, reason, message, warning)
        if created is not None:
            self._series[slot] = _Series(key, created["metadata"]["name"], 1)

    async def _post(self, owner: Owner, reason: str, message: str, warning: bool) -> dict[str, Any] | None:
        now = now_iso()
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{owner.name}.", "namespace": owner.namespace},
            "involvedObject": {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND, "name": owner.name,
                               "namespace": owner.namespace, "uid": owner.uid},
            "reason": reason, "message": message, "type": "Warning" if warning else "Normal",
            "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
            "reportingInstance": self.instance, "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        try:
            return await self.kube.create(core_path(owner.namespace, "events"), body)
        except KubeError as exc:
            log.warning("could not post event %s on %s/%s: %s", reason, owner.namespace, owner.name, exc)
            return None
