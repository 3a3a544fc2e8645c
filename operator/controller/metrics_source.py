"""The autoscaler's live metrics: a deployment's frontend pods' /metrics and its workers' Stats.

`PodMetricsSource.sample(target, replicas)` (scaling_task.MetricsSource) reads, at one time:

- every frontend pod of the deployment (label role=frontend) that is Ready, not being deleted
  and has a pod IP: `GET http://<podIP>:<spec.frontend.port>/metrics`, the Prometheus text the
  frontend exports (request counters, prompt and generated tokens, TTFT and inter-token
  histograms);
- every worker group's rank-0 pod that is Ready and not draining: the Stats RPC (KV usage,
  running and waiting requests, prompt tokens computed, tokens generated), at the address
  the drain protocol uses (drain.worker_address: the worker-address annotation, else
  podIP:50051; with `--worker-address annotation` only the annotation). A worker that does
  not answer is left out of the reading; with TLS to the workers, SPLITSERVE_TLS_* as for the
  drain calls.

The difference between this reading and the deployment's previous one becomes the planner's
`MetricsSample`, by the same rules as `splitserve serve --autoscale`
(services/planner/readings.py: `SampleBuilder`, whose header gives them). The first
reading of a deployment only sets the baseline (None). None too when no frontend is ready,
or one does not answer; and when the set of frontend pods changed since the previous reading
(their counters are summed, so a frontend that came or went would look like a burst or a
restart), the reading is a new baseline.

In the test environment (tests/k8s, kwok nodes) pods run no process, so the k8s test hands
the operator a stand-in source instead; this one is tested against a real HTTP server and a
real gRPC Stats servicer (tests/unit/operator/test_metrics_source.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import httpx

from splitserve.operator import names
from splitserve.operator.drain import worker_address
from splitserve.operator.groups import PodState, observe_groups
from splitserve.operator.kube import AsyncKube, core_path
from splitserve.operator.scaling_task import AutoscaleTarget
from splitserve.services.planner.readings import FrontendCounters, Reading, SampleBuilder, WorkerCounters
from splitserve.services.planner import MetricsSample, ReplicaCounts
from splitserve.tls import TlsConfig

log = logging.getLogger(__name__)
SCRAPE_TIMEOUT_S = 2.0


@dataclass(slots=True)
class _Deployment:
    builder: SampleBuilder = field(default_factory=SampleBuilder)
    frontends: frozenset[str] = frozenset()


class PodMetricsSource:
    def __init__(self, kube: AsyncKube, use_pod_ip: bool = True, timeout_s: float = SCRAPE_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic):
        self.kube = kube
        self.use_pod_ip = use_pod_ip
        self.timeout_s = timeout_s
        self.clock = clock
        self._deployments: dict[str, _Deployment] = {}

    def forget(self, uid: str) -> None:
        self._deployments.pop(uid, None)

    async def sample(self, target: AutoscaleTarget, replicas: ReplicaCounts) -> MetricsSample | None:
        owner = target.owner
        where = f"{owner.namespace}/{owner.name}"
        pods = await self.kube.list(core_path(owner.namespace, "pods"),
                                    label_selector=f"{names.LABEL_DEPLOYMENT}={owner.name}")
        frontends = frontend_urls(pods, target.spec.frontend.port)
        if not frontends:
            log.info("autoscale %s: no ready frontend pod to read metrics from", where)
            return None
        workers = worker_targets(pods, self.use_pod_ip)
        timestamp = self.clock()
        texts, stats = await asyncio.gather(
            asyncio.gather(*(self._get(url) for url in frontends.values()), return_exceptions=True),
            asyncio.gather(*(self._stats(address) for _, address in workers.values())))
        failed = [f"{name}: {error}" for name, error in zip(frontends, texts) if isinstance(error, BaseException)]
        state = self._deployments.setdefault(owner.uid, _Deployment())
        if failed:
            log.info("autoscale %s: cannot read a frontend's /metrics (%s)", where, "; ".join(failed))
            self._deployments[owner.uid] = _Deployment()     # the next reading is a new baseline
            return None
        reading = Reading(timestamp, FrontendCounters.total(FrontendCounters.parse(t) for t in texts),
                          tuple(WorkerCounters.of_stats(role, s) for (role, _), s in zip(workers.values(), stats)
                                if s is not None))
        names_now = frozenset(frontends)
        if names_now != state.frontends:
            state = self._deployments[owner.uid] = _Deployment(frontends=names_now)
        return state.builder.sample(reading, replicas)

    async def _get(self, url: str) -> str:
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            response = await client.get(url)
            response.raise_for_status()
            return response.text

    async def _stats(self, address: str):
        from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc

        try:
            async with TlsConfig.client_from_env().aio_channel(address) as channel:
                return await worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(),
                                                                       timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.info("worker at %s did not answer Stats: %s", address, exc.code().name)
            return None


def frontend_urls(pods: list[dict], port: int) -> dict[str, str]:
    """Pod name -> its /metrics URL, for the deployment's ready frontend pods."""
    out = {}
    for doc in pods:
        if (doc["metadata"].get("labels") or {}).get(names.LABEL_ROLE) != "frontend":
            continue
        pod = PodState.from_doc(doc)
        if pod.ready and not pod.deleting and pod.pod_ip:
            out[pod.name] = f"http://{pod.pod_ip}:{port}/metrics"
    return out


def worker_targets(pods: list[dict], use_pod_ip: bool) -> dict[str, tuple[str, str]]:
    """Group name -> (role, its rank-0 worker's gRPC address), for ready groups not draining."""
    out = {}
    for pool, groups in observe_groups(pods).items():
        for group in groups:
            leader = group.leader
            if group.draining or not group.ready or leader is None:
                continue
            address = worker_address(leader, use_pod_ip)
            if address:
                out[group.name] = (pool, address)
    return out
