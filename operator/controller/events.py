"""Kubernetes Events on a ServingDeployment: one per reconcile step (`kubectl describe sd` shows them)."""

from __future__ import annotations

import datetime as dt
import logging
import socket

from splitserve.operator.builders import Owner
from splitserve.operator.kube import AsyncKube, KubeError, core_path
from splitserve.operator.spec import API_GROUP, API_VERSION, KIND

log = logging.getLogger(__name__)
COMPONENT = "splitserve-operator"


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class EventRecorder:
    def __init__(self, kube: AsyncKube):
        self.kube = kube
        self.instance = socket.gethostname()

    async def record(self, owner: Owner, reason: str, message: str, warning: bool = False) -> None:
        """Post one Event; a failure to post is logged, never raised (events are best effort)."""
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
        (log.warning if warning else log.info)("%s/%s: %s: %s", owner.namespace, owner.name, reason, message)
        try:
            await self.kube.create(core_path(owner.namespace, "events"), body)
        except KubeError as exc:
            log.warning("could not post event %s on %s/%s: %s", reason, owner.namespace, owner.name, exc)
