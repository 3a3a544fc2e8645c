"""Leader election on a coordination.k8s.io Lease, so that several operator replicas
can run and exactly one reconciles and schedules.

`LeaseElector.ensure()` makes one attempt and says whether this process leads:
it creates the Lease when there is none, renews it when it holds it (at most
every `lease_s / 3`), and takes it over when the holder's renewTime is older
than `lease_s`. Updates carry the Lease's resourceVersion, so two replicas
racing for an expired Lease cannot both win (the loser gets HTTP 409).
"""

from __future__ import annotations

import datetime as dt
import logging
import time

from splitserve.operator.kube import AsyncKube, KubeError

log = logging.getLogger(__name__)


def _micro_time(moment: dt.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(text: str | None) -> dt.datetime | None:
    if not text:
        return None
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


class LeaseElector:
    def __init__(self, kube: AsyncKube, namespace: str, identity: str, name: str = "splitserve-operator",
                 lease_s: int = 15):
        self.kube = kube
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"
        self.name = name
        self.namespace = namespace
        self.identity = identity
        self.lease_s = lease_s
        self._renewed_at = 0.0        # time.monotonic() of our last successful write
        self.leading = False

    async def ensure(self) -> bool:
        if self.leading and time.monotonic() - self._renewed_at < self.lease_s / 3:
            return True
        try:
            leading = await self._attempt()
        except KubeError as exc:
            if not exc.conflict:
                log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
            leading = False
        if leading != self.leading:
            log.warning("%s leadership of lease %s/%s as %s", "took" if leading else "lost",
                        self.namespace, self.name, self.identity)
        self.leading = leading
        return leading

    async def _attempt(self) -> bool:
        now = dt.datetime.now(dt.timezone.utc)
        lease = await self.kube.get(self.path)
        if lease is None:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": {"holderIdentity": self.identity, "leaseDurationSeconds": self.lease_s,
                             "acquireTime": _micro_time(now), "renewTime": _micro_time(now),
                             "leaseTransitions": 0}}
            await self.kube.create(self.path.rsplit("/", 1)[0], body)
            self._renewed_at = time.monotonic()
            return True
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        renewed = _parse(spec.get("renewTime")) or _parse(spec.get("acquireTime"))
        duration = spec.get("leaseDurationSeconds") or self.lease_s
        expired = renewed is None or renewed + dt.timedelta(seconds=duration) < now
        if holder and holder != self.identity and not expired:
            return False
        if holder != self.identity:
            spec["acquireTime"] = _micro_time(now)
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        spec.update(holderIdentity=self.identity, renewTime=_micro_time(now), leaseDurationSeconds=self.lease_s)
        lease["spec"] = spec
        await self.kube.request("PUT", self.path, lease)   # carries resourceVersion: 409 if someone won
        self._renewed_at = time.monotonic()
        return True
