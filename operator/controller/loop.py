"""The operator's control loop: reconcile every ServingDeployment, then run one gang-scheduling pass.

One asyncio task with a handle (`run`/`stop`). It wakes every `interval_s`
or sooner when kopf reports a watch event (`wake()`), with at least
`min_interval_s` between passes so an event storm cannot spin it. One pass
reconciles all deployments in the watched namespaces, then schedules all
waiting groups, so a group created in a pass is usually bound in the same pass.
With several replicas, only the holder of the Lease (`leader.LeaseElector`) runs passes.

Beside it, on its own cadence (each deployment's spec.autoscaling.intervalSeconds), runs the
SLO autoscaler (scaling_task.py) as a second task: its scrapes never hold up a pass, and a
scale it applies wakes the loop. It too runs only while this replica leads. Its metrics
come from `metrics_source` (default: metrics_source.PodMetricsSource, the live scrape).
"""

from __future__ import annotations

import asyncio
import logging
import time

from splitserve.operator.scaling_task import Autoscaler, MetricsSource
from splitserve.operator.events import EventRecorder
from splitserve.operator.kube import AsyncKube, KubeError, core_path, group_path
from splitserve.operator.leader import LeaseElector
from splitserve.operator.reconciler import Reconciler
from splitserve.operator.scheduler import GangScheduler, not_ready_seconds
from splitserve.services.spec.serving_deployment import API_GROUP, API_VERSION, PLURAL
from splitserve.operator.builders import WorkloadOptions

log = logging.getLogger(__name__)


class OperatorLoop:
    def __init__(self, kube: AsyncKube, namespaces: list[str], etcd_endpoints: list[str],
                 interval_s: float = 2.0, min_interval_s: float = 0.3, use_pod_ip: bool = True,
                 elector: LeaseElector | None = None, node_grace_s: float = 10.0,
                 workload: WorkloadOptions = WorkloadOptions(), metrics_source: MetricsSource | None = None):
        self.kube = kube
        self.elector = elector        # None: this process always leads (one replica)
        # A node NotReady for less than this still counts for the groups on it (a kubelet
        # blip must not replace a whole group); the gang scheduler never places on it.
        self.node_grace_s = node_grace_s
        self.namespaces = namespaces
        self.scheduler = GangScheduler(kube, namespaces)
        events = EventRecorder(kube)
        self.reconciler = Reconciler(kube, self.scheduler, events, etcd_endpoints,
                                     use_pod_ip=use_pod_ip, workload=workload)
        if metrics_source is None:
            from splitserve.operator.metrics_source import PodMetricsSource
            metrics_source = PodMetricsSource(kube, use_pod_ip=use_pod_ip)
        self.autoscaler = Autoscaler(kube, events, metrics_source, self._deployments,
                                     leading=lambda: elector is None or elector.leading, on_scaled=self.wake)
        self.interval_s = interval_s
        self.min_interval_s = min_interval_s
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self.num_passes = 0

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    async def run(self) -> None:
        log.info("operator loop started (namespaces: %s)", ", ".join(self.namespaces) or "all")
        autoscaler = asyncio.create_task(self.autoscaler.run(self._stopping), name="splitserve-autoscaler")
        try:
            await self._run_passes()
        finally:
            self._stopping.set()
            await autoscaler
        log.info("operator loop stopped")

    async def _run_passes(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            try:
                if self.elector is None or await self.elector.ensure():
                    await self.run_pass()
            except (KubeError, OSError) as exc:
                log.warning("pass failed, retrying: %s", exc)
            except Exception:  # one bad pass must not end the operator
                log.exception("pass failed, retrying")
            await asyncio.sleep(self.min_interval_s)
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            except TimeoutError:
                pass

    async def run_pass(self) -> None:
        nodes = await self.kube.list(core_path(None, "nodes"))
        now = time.time()
        ready = {n["metadata"]["name"]: not_ready_seconds(n, now) < self.node_grace_s for n in nodes}
        for body in await self._deployments():
            if body["metadata"].get("deletionTimestamp"):
                continue   # the garbage collector removes what it owned
            try:
                await self.reconciler.reconcile(body, ready)
            except KubeError as exc:
                log.warning("reconcile %s/%s: %s", body["metadata"]["namespace"], body["metadata"]["name"], exc)
        await self.scheduler.run_pass()
        self.num_passes += 1

    async def _deployments(self) -> list[dict]:
        if not self.namespaces:
            return await self.kube.list(group_path(API_GROUP, API_VERSION, None, PLURAL))
        found = []
        for namespace in self.namespaces:
            found += await self.kube.list(group_path(API_GROUP, API_VERSION, namespace, PLURAL))
        return found
