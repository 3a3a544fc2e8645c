"""spec.autoscaling on the real control plane: the operator follows the SLO planner through the
ServingPools' scale subresources, and the pools' pods follow.

The operator runs in this process (`OperatorLoop`, the loop `splitserve operator` runs under
kopf; kopf only wakes it) against the test apiserver, with kwok GPU nodes whose pods go
Running and Ready without running anything. Its live metrics source
(operator/controller/metrics_source.py) scrapes the frontend pods' /metrics and the workers'
Stats, which kwok pods do not serve, so the operator is handed `StandInMetrics`, a stand-in
for the live scrape: a load level the test sets, as planner samples. Everything from the
sample on is the operator's own: the planner's decision, the scale subresource patch, the
reconciler copying the count and creating or draining groups, the gang scheduler binding the
pods, the Event and status.autoscaling.

Also: the CRD's schema refuses bad spec.autoscaling values on the real apiserver.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path

import pytest

from cluster import wait_until
from operator_env import Api, pool_status, sd_doc

from splitserve.operator.kube import AsyncKube, Kube, load_api_client
from splitserve.operator.loop import OperatorLoop
from splitserve.services.planner import MetricsSample, ReplicaCounts

CRDS = Path(__file__).resolve().parents[2] / "deploy/helm/splitserve/crds"
SD = "auto"
WAIT_S = 60.0
COOLDOWN_S = 6
QUIET_RATE, BUSY_RATE = 1.0, 10.0        # requests/s: the decode pool needs 1 group, then 3
POOL = {"replicas": 1, "gpusPerRank": 1, "topology": {"mode": "none"}, "resources": {"cpu": "100m", "memory": "128Mi"}}
AUTOSCALING = {
    "enabled": True, "ttftP90Ms": 1000, "itlP90Ms": 100, "intervalSeconds": 1, "cooldownSeconds": COOLDOWN_S,
    "maxWorkers": 6, "prefill": {"minReplicas": 1, "maxReplicas": 2}, "decode": {"minReplicas": 1, "maxReplicas": 4},
    # One group: prompt tokens at 10000/s; 10 sequences at 100 tokens/s, i.e. 100 ms per token at batch 10.
    "profile": {"prefillTokensPerSecond": 10000, "decodeTokensPerSecond": 100, "decodeBatchSize": 10,
                "startupSeconds": 0},
}
SPEC = {"model": {"source": "smollm2"}, "frontend": {"replicas": 0}, "prefill": POOL, "decode": POOL,
        "drainTimeoutSeconds": 5, "autoscaling": AUTOSCALING}


class StandInMetrics:
    """Stand-in for the live scrape (metrics_source.PodMetricsSource): each call is one interval
    at `rate` requests/s of 100-token prompts and 20-token outputs, latencies within the SLO."""

    def __init__(self, rate: float):
        self.rate = rate
        self.last: dict[str, float] = {}
        self.calls = 0

    async def sample(self, target, replicas: ReplicaCounts) -> MetricsSample | None:
        now = time.monotonic()
        previous = self.last.get(target.owner.uid)
        self.last[target.owner.uid] = now
        self.calls += 1
        if previous is None:
            return None                        # as the live scrape: the first reading is a baseline
        interval = now - previous
        return MetricsSample(timestamp=now, interval_s=interval, num_arrivals=round(self.rate * interval),
                             prompt_tokens_mean=100, prompt_tokens_p90=100, output_tokens_mean=20,
                             replicas=replicas, ttft_p90_s=0.2, itl_p90_s=0.05)

    def forget(self, uid: str) -> None:
        self.last.pop(uid, None)


class LogLines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


class InProcessOperator:
    """`OperatorLoop` on its own thread and event loop, with an injected metrics source."""

    def __init__(self, kubeconfig: Path, namespace: str, source: StandInMetrics):
        self.log = LogLines()
        self._logger = logging.getLogger("splitserve.operator")
        self._level = self._logger.level
        self._logger.addHandler(self.log)
        self._logger.setLevel(logging.INFO)
        kube = AsyncKube(Kube(load_api_client(kubeconfig)))
        self.event_loop = asyncio.new_event_loop()
        self.loop: OperatorLoop | None = None
        self.error: BaseException | None = None
        ready = threading.Event()

        def main():
            asyncio.set_event_loop(self.event_loop)
            try:
                self.loop = OperatorLoop(kube, [namespace], ["127.0.0.1:1"], interval_s=0.5, use_pod_ip=False,
                                         node_grace_s=4, metrics_source=source)
                ready.set()
                self.event_loop.run_until_complete(self.loop.run())
            except BaseException as exc:       # noqa: BLE001 - reported by stop()
                self.error = exc
                ready.set()

        self.thread = threading.Thread(target=main, name="operator", daemon=True)
        self.thread.start()
        ready.wait(30)

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.lines[-n:])

    def stop(self) -> None:
        if self.loop is not None:
            self.event_loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self._logger.removeHandler(self.log)
        self._logger.setLevel(self._level)
        assert not self.thread.is_alive(), "the operator loop did not stop"
        assert self.error is None, repr(self.error)


class Env:
    def __init__(self, cluster, namespace: str, operator: InProcessOperator, source: StandInMetrics):
        self.cluster = cluster
        self.namespace = namespace
        self.operator = operator
        self.source = source
        self.api = Api(cluster, namespace)

    def wait(self, predicate, what: str, timeout: float = WAIT_S):
        try:
            return wait_until(predicate, timeout=timeout, what=what, interval=0.2)
        except TimeoutError as exc:
            status = json.dumps((self.api.sd(SD) or {}).get("status"), indent=1)
            raise AssertionError(f"{exc}\n--- status ---\n{status}\n--- operator log ---\n"
                                 f"{self.operator.tail()}") from None

    def pool(self, pool: str, *args: str) -> dict:
        return self.api.kubectl_json("get", "servingpool", f"{SD}-{pool}", *args)

    def running_groups(self, pool: str) -> set[str]:
        """Groups of the pool whose pods are all bound and Running, none of them going."""
        groups = self.api.groups(SD, pool)
        return {name for name, pods in groups.items()
                if all(p["spec"].get("nodeName") and p.get("status", {}).get("phase") == "Running"
                       and not p["metadata"].get("deletionTimestamp")
                       and "splitserve.io/draining" not in p["metadata"]["labels"] for p in pods)}

    def decisions(self) -> list[str]:
        return self.api.event_messages(SD, "AutoscaleDecision")


@pytest.fixture(scope="module")
def env(kube_cluster):
    namespace = kube_cluster.create_namespace("autoscale")
    for crd in sorted(CRDS.glob("*.yaml")):
        kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    for crd in ("servingdeployments.splitserve.io", "servingpools.splitserve.io"):
        kube_cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=30s")
    node = f"auto-{namespace[-5:]}"
    kube_cluster.add_gpu_node(node, gpus=8)
    source = StandInMetrics(QUIET_RATE)
    operator = InProcessOperator(kube_cluster.kubeconfig, namespace, source)
    try:
        yield Env(kube_cluster, namespace, operator, source)
    finally:
        try:
            operator.stop()
        finally:
            kube_cluster.delete_namespace(namespace)
            kube_cluster.delete_node(node, wait=False)


@pytest.mark.parametrize("autoscaling, message", [
    ({"enabled": True, "itlP90Ms": 50},
     "autoscaling.ttftP90Ms and autoscaling.itlP90Ms are required when autoscaling is enabled"),
    ({**AUTOSCALING, "decode": {"minReplicas": 3, "maxReplicas": 2}}, "maxReplicas must be >= minReplicas"),
    ({**AUTOSCALING, "maxWorkers": 3, "decode": {"minReplicas": 3}},
     "autoscaling.maxWorkers must be >= prefill.minReplicas + decode.minReplicas"),
    ({**AUTOSCALING, "prefill": {"minReplicas": 0}},
     "spec.autoscaling.prefill.minReplicas in body should be greater than or equal to 1"),
    ({**AUTOSCALING, "ttftP90Ms": 0}, "spec.autoscaling.ttftP90Ms in body should be greater than 0"),
    ({**AUTOSCALING, "intervalSeconds": 0}, "spec.autoscaling.intervalSeconds in body should be greater than or equal to 1"),
    ({**AUTOSCALING, "replicas": 2}, 'unknown field "spec.autoscaling.replicas"'),
])
def test_bad_autoscaling_is_refused_by_the_schema(env, autoscaling, message):
    result = env.api.apply(sd_doc("bad", {"model": {"source": "smollm2"}, "autoscaling": autoscaling}), check=False)
    assert result.returncode != 0, result.stdout
    assert message in " ".join(result.stderr.split()), result.stderr


def test_schema_defaults_fill_the_autoscaling_fields(env):
    env.api.apply(sd_doc("defaults", {"model": {"source": "smollm2"}, "frontend": {"replicas": 0},
                                      "prefill": {"replicas": 0}, "decode": {"replicas": 0},
                                      "autoscaling": {"ttftP90Ms": 500, "itlP90Ms": 40, "profile": {}}}))
    stored = env.api.sd("defaults")["spec"]["autoscaling"]
    assert stored["enabled"] is False and stored["intervalSeconds"] == 30 and stored["cooldownSeconds"] == 300
    assert stored["profile"] == {"prefillTokensPerSecond": 8000, "decodeTokensPerSecond": 800, "decodeBatchSize": 32,
                                 "startupSeconds": 60}
    env.cluster.kubectl("-n", env.namespace, "delete", "sd", "defaults", "--wait=false")


def test_the_operator_follows_the_planner_through_the_serving_pools(env):
    api = env.api
    env.api.apply(sd_doc(SD, SPEC))
    # Quiet: 1 prefill + 1 decode group, as the spec says; the planner agrees (it changes nothing).
    env.wait(lambda: len(env.running_groups("prefill")) == 1 and len(env.running_groups("decode")) == 1,
             "one prefill and one decode group Running")
    env.wait(lambda: ((api.sd(SD).get("status") or {}).get("autoscaling") or {}).get("replicas") == "1P+1D",
             "a first decision in status.autoscaling")
    assert env.pool("decode")["spec"]["replicas"] == 1

    # A step up in load: the decode pool (the one that binds: 20-token outputs at 10 req/s) grows
    # at once to 3 groups, through the ServingPool's scale subresource.
    env.source.rate = BUSY_RATE
    env.wait(lambda: env.pool("decode")["spec"]["replicas"] == 3, "the decode ServingPool scaled to 3")
    scaled_up_at = time.monotonic()
    # Who wrote spec.replicas, and through what: the Scale, as an HPA would.
    pool = env.pool("decode", "--show-managed-fields")
    managers = [(m.get("manager"), m.get("subresource")) for m in pool["metadata"]["managedFields"]
                if "f:replicas" in json.dumps(m.get("fieldsV1", {}))]
    assert any(sub == "scale" for _, sub in managers), managers
    assert env.pool("prefill")["spec"]["replicas"] == 1
    # The pods follow: the reconciler copies the count into the ServingDeployment and creates
    # two groups, the gang scheduler binds them, kwok runs them.
    env.wait(lambda: len(env.running_groups("decode")) == 3, "three decode groups Running")
    assert api.sd(SD)["spec"]["decode"]["replicas"] == 3 and len(env.running_groups("prefill")) == 1
    up = env.wait(lambda: [m for m in env.decisions() if "1P+1D -> 1P+3D" in m], "the scale-up Event")
    assert "decode 1->3 [itl, needs 3" in up[0], up[0]
    assert any(f"autoscale {env.namespace}/{SD}: {up[0]}" in line for line in env.operator.log.lines)
    status = api.sd(SD)["status"]["autoscaling"]
    assert status["decode"]["chosen"] == 3 and status["binding"] == "prefill: utilisation, decode: itl"
    assert "lastScaleTime" in status
    assert status["observed"]["ttftP90Ms"] == 200.0 and status["observed"]["arrivalRate"] > 5

    # Quiet again: the count holds through the cool-down, then comes down, and the groups it
    # removes are drained and deleted.
    env.source.rate = QUIET_RATE
    env.wait(lambda: env.pool("decode")["spec"]["replicas"] == 1, "the decode ServingPool scaled back to 1",
             timeout=WAIT_S + COOLDOWN_S)
    held_s = time.monotonic() - scaled_up_at
    assert held_s >= COOLDOWN_S - 1, f"scaled down {held_s:.1f} s after the scale-up (cool-down {COOLDOWN_S} s)"
    env.wait(lambda: len(api.groups(SD, "decode")) == 1 and len(env.running_groups("decode")) == 1,
             "the extra decode groups drained and deleted")
    assert api.sd(SD)["spec"]["decode"]["replicas"] == 1
    down = env.wait(lambda: [m for m in env.decisions() if "1P+3D -> 1P+1D" in m], "the scale-down Event")
    assert "decode 3->1" in down[0], down[0]
    assert api.event_messages(SD, "Drained"), "the removed groups were drained"
    assert pool_status(api.sd(SD), "decode")["desired"] == 1
    assert api.sd(SD)["status"]["autoscaling"]["replicas"] == "1P+1D"
    assert not api.event_messages(SD, "AutoscaleFailed")
    # Every decision is recorded: the same decision again bumps its Event's count.
    counts = [e.get("count", 1) for e in api.events(SD) if e["reason"] == "AutoscaleDecision"]
    assert max(counts) > 1 and sum(counts) >= 1 + COOLDOWN_S, counts


def test_with_switch_modes_the_operator_runs_the_deployment_aggregated_and_back(env):
    api = env.api
    env.source.rate = QUIET_RATE
    switch_modes = lambda on: env.cluster.kubectl(  # noqa: E731
        "-n", env.namespace, "patch", "sd", SD, "--type", "merge",
        "-p", json.dumps({"spec": {"autoscaling": {"switchModes": on}}}))
    env.wait(lambda: len(env.running_groups("prefill")) == 1 and len(env.running_groups("decode")) == 1,
             "one prefill and one decode group Running")
    switch_modes(True)
    # Quiet: one aggregated group does the work of a prefill and a decode group. After the
    # cool-down the planner switches: the prefill ServingPool goes to 0 through its scale
    # subresource and its group is drained and deleted; the decode group stays, and prefills
    # its own prompts (the router sends a request no prefill worker when none is registered).
    env.wait(lambda: env.pool("prefill")["spec"]["replicas"] == 0, "the prefill ServingPool scaled to 0",
             timeout=WAIT_S + COOLDOWN_S)
    env.wait(lambda: not api.groups(SD, "prefill"), "the prefill group drained and deleted")
    assert env.pool("decode")["spec"]["replicas"] == 1 and len(env.running_groups("decode")) == 1
    switch = env.wait(lambda: [m for m in env.decisions() if "1P+1D -> 1A aggregated" in m], "the switch Event")
    assert "switch from disaggregated" in switch[0], switch[0]
    assert api.sd(SD)["spec"]["prefill"]["replicas"] == 0
    env.wait(lambda: api.sd(SD)["status"]["autoscaling"]["replicas"] == "1A", "status.autoscaling at 1A")
    status = api.sd(SD)["status"]["autoscaling"]
    assert status["mode"] == "aggregated" and status["aggregated"]["chosen"] == 1, status
    # switchModes off: the planner runs disaggregated again and brings the prefill pool to its minimum.
    switch_modes(False)
    env.wait(lambda: env.pool("prefill")["spec"]["replicas"] == 1, "the prefill ServingPool back at 1")
    env.wait(lambda: len(env.running_groups("prefill")) == 1, "a prefill group Running again")
    back = env.wait(lambda: [m for m in env.decisions() if "0P+1D -> 1P+1D" in m], "the way-back Event")
    assert "prefill 0->1" in back[0], back[0]
    assert not api.event_messages(SD, "AutoscaleFailed")


def test_turning_autoscaling_off_clears_its_status(env):
    api = env.api
    env.api.apply(sd_doc(SD, {**SPEC, "autoscaling": {**AUTOSCALING, "enabled": False}}))
    env.wait(lambda: "autoscaling" not in (api.sd(SD).get("status") or {}), "status.autoscaling removed")
    calls = env.source.calls
    time.sleep(2.5)      # two 1 s intervals, in which an autoscaler still on would read metrics
    assert env.source.calls == calls, "no metrics read while autoscaling is off"
