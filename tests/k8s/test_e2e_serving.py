"""End to end on the test control plane with real processes: the chart, the operator's pods,
worker groups that span pods, and what users do to a running deployment.

One deployment for the module (e2e_env.py): `helm install` with etcd over TLS and
client certificates, the chart's operator running in a pod of the test node agent,
and a ServingDeployment of 1 prefill group and 2 decode groups of tensorParallel 2
(each two pods: rank 1 joins rank 0's gloo group through the headless Service's
name). The tests run in file order, each starting from the state the one before
left, as an operator's day goes: serve, scale up, lose a pod, scale down, roll, and
run without prefill groups (the aggregated mode of the planner's switchModes) and back.
Every answer is checked token for token against transformers' greedy output
(e2e_load.py), and every scenario ends with the leak check on every worker.
"""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path

import openai
import pytest

from cluster import wait_until
from controlplane import KubeCluster
from e2e_env import ENGINE_ARGS, SD_NAME, E2EDeployment, e2e_deployment, elapsed
from e2e_load import Load, Tally, run_one, served_model, stream

from splitserve.operator import names
from splitserve.testing.metrics import scrape
from splitserve.testing.models import random_prompt
from splitserve.testing.oracle import assert_greedy_match, hf_greedy
from splitserve.testing.processes import Proc
from splitserve.testing.workers import wait_idle

SHORT = 24                # tokens of the load's requests
LONG = 160                # tokens of the streams a deleted pod must migrate
LEAK_LIMIT_S = 15.0


@pytest.fixture(scope="module")
def e2e(kube_cluster: KubeCluster, llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with e2e_deployment(kube_cluster, "e2e", llama_dir, tmp_path_factory.mktemp("e2e")) as env:
        yield env


@pytest.fixture(scope="module")
def cases(llama_dir: Path):
    prompts = [random_prompt(seed, n) for seed, n in ((1, 12), (2, 45), (3, 70), (4, 130))]
    return list(zip(prompts, hf_greedy(llama_dir, prompts, SHORT, ignore_eos=True)))


@pytest.fixture(scope="module")
def fresh_cases(llama_dir: Path):
    """Prompts no other test sends, so no worker holds a block of them."""
    prompts = [random_prompt(200 + i, 40) for i in range(6)]
    return list(zip(prompts, hf_greedy(llama_dir, prompts, SHORT, ignore_eos=True)))


@pytest.fixture(scope="module")
def long_cases(llama_dir: Path):
    prompts = [random_prompt(100 + i, 20 + 7 * i) for i in range(4)]
    return list(zip(prompts, hf_greedy(llama_dir, prompts, LONG, ignore_eos=True)))


def _assert_no_leaks(e2e: E2EDeployment) -> None:
    workers = e2e.workers()
    wait_idle(workers, LEAK_LIMIT_S)
    print(f"[e2e] no KV block held on {len(workers)} workers: {sorted(workers)}")


def _frontend_metric(e2e: E2EDeployment, name: str, **labels: str) -> float:
    return scrape(f"http://{e2e.open_frontend()}/metrics", name, **labels)


def _serve_reference(model_dir: Path, cases) -> list[list[int]]:
    """The same prompts through `splitserve serve` on this machine (no Kubernetes)."""
    from splitserve.net import free_port

    port = free_port()
    proc = Proc.start(["splitserve", "serve", "--model", str(model_dir), "--dtype", "float32", "--port", str(port),
                       "--grpc-port", str(free_port()), "--threads", "1", "--kv-cache-gib", "0.05"])
    try:
        proc.wait_for_line(r"splitserve is ready: ", 180)
        model = served_model(f"127.0.0.1:{port}")
        return [stream(f"127.0.0.1:{port}", model, prompt, len(ref.token_ids)) for prompt, ref in cases]
    finally:
        assert proc.stop() == 0, proc.output


def test_helm_install_serves_token_exact_through_pods(e2e: E2EDeployment, cases, llama_dir: Path):
    t0 = time.monotonic()
    e2e.apply(decode_replicas=2)
    e2e.wait_ready(decode=2, timeout=240)
    print(f"[e2e] ServingDeployment Ready (1 prefill, 2 decode groups of TP=2) in {elapsed(t0)}")
    decode, prefill = e2e.groups("decode"), e2e.groups("prefill")
    assert len(decode) == 2 and len(prefill) == 1
    for group in decode.values():                       # two pods per group: ranks 0 and 1
        assert sorted(p["metadata"]["labels"][names.LABEL_RANK] for p in group) == ["0", "1"]
        rank1 = next(p for p in group if p["metadata"]["labels"][names.LABEL_RANK] == "1")
        env = {v["name"]: v.get("value") for v in rank1["spec"]["containers"][0]["env"]}
        assert env["SPLITSERVE_TP_RANK"] == "1" and env["SPLITSERVE_TP_WORLD_SIZE"] == "2"
        assert rank1["status"]["phase"] == "Running"
    every_pod = e2e.api.kubectl_json("get", "pods")["items"]
    assert {p["spec"]["nodeName"] for p in every_pod} == {e2e.agent.node_name}
    # Workers and the frontend reach etcd over TLS with the client Secret the chart named.
    for pod in every_pod:
        if pod["metadata"]["labels"].get(names.LABEL_ROLE) in ("prefill", "decode", "frontend"):
            args = pod["spec"]["containers"][0]["args"]
            assert args[args.index("--etcd-cert") + 1] == "/etc/splitserve/etcd-tls/tls.crt", args
    registered = {r.get("address") for r in e2e.etcd_records()}
    rank0 = e2e.rank0_pods()
    assert {f"{p['status']['podIP']}:{names.WORKER_PORT}" for p in rank0} <= registered, registered

    base = e2e.open_frontend()
    model = served_model(base)
    before = e2e.stats()
    decode_names = {p["metadata"]["name"] for p in e2e.rank0_pods("decode")}
    routed_before = {n: _frontend_metric(e2e, "splitserve_router_decisions_total", leg="decode", winner=n)
                     for n in decode_names}
    ours = [stream(base, model, prompt, len(ref.token_ids)) for prompt, ref in cases]
    for tokens, (_, ref) in zip(ours, cases):
        assert_greedy_match(tokens, ref)
        assert len(tokens) == len(ref.token_ids)
    after = e2e.stats()
    served = {n: after[n].num_requests - before[n].num_requests for n in after}
    prefilled = {n: after[n].num_prefills_served - before[n].num_prefills_served for n in after}
    routed = {n: _frontend_metric(e2e, "splitserve_router_decisions_total", leg="decode", winner=n)
                 - routed_before[n] for n in decode_names}
    assert routed == {n: 2 for n in decode_names}, routed               # round robin over both groups
    # The workers saw those requests; their counts may also hold the readiness probe's one-token
    # canaries (every 10 s, operator/controller/probe.py), so they are at least the routed ones.
    assert all(served[n] >= 2 for n in decode_names), served
    assert sum(prefilled.values()) == len(cases), prefilled              # threshold 0: all prefilled remotely
    assert ours == _serve_reference(llama_dir, cases)                    # and what `splitserve serve` answers
    _assert_one_trace_across_the_pods(e2e, base, model, cases[1][0])
    _assert_no_leaks(e2e)


def _assert_one_trace_across_the_pods(e2e: E2EDeployment, base: str, model: str, prompt: list[int]) -> None:
    """spec.tracing: a request sent with a client's traceparent is one trace across the frontend
    pod, the decode group's rank-0 pod and the prefill group's (threshold 0: prefilled remotely),
    each span naming its pod and namespace."""
    trace_id, client_span_id = secrets.token_hex(16), secrets.token_hex(8)
    with openai.OpenAI(base_url=f"http://{base}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0,
                                        extra_headers={"traceparent": f"00-{trace_id}-{client_span_id}-01"})
    assert out.usage.completion_tokens == 2

    def whole():
        spans = {s.name: s for s in e2e.collector.trace(trace_id)}
        return spans if {"llm_request", "generate", "prefill", "kv_transfer", "decode"} <= spans.keys() else None
    spans = wait_until(whole, timeout=30, what=f"every span of trace {trace_id}",
                       details=lambda: sorted((s.resource.get("k8s.pod.name"), s.name)
                                              for s in e2e.collector.trace(trace_id)))
    root, generate, prefill = spans["llm_request"], spans["generate"], spans["prefill"]
    assert root.parent_span_id == client_span_id
    pods = {p["metadata"]["name"]: p["metadata"]["labels"].get(names.LABEL_ROLE)
            for p in e2e.api.kubectl_json("get", "pods")["items"]}
    assert pods[root.resource["k8s.pod.name"]] == "frontend"
    assert pods[generate.resource["k8s.pod.name"]] == "decode" == pods[generate.instance]
    assert pods[prefill.resource["k8s.pod.name"]] == "prefill"
    assert {s.resource["k8s.namespace.name"] for s in spans.values()} == {e2e.namespace}
    print(f"[e2e] one trace over {sorted({s.resource['k8s.pod.name'] for s in spans.values()})}")


def test_kubectl_scale_adds_a_decode_group_that_registers_and_serves(e2e: E2EDeployment, fresh_cases):
    before = set(e2e.groups("decode"))
    t0 = time.monotonic()
    e2e.cluster.kubectl("-n", e2e.namespace, "scale", f"servingpool/{names.pool_resource_name(SD_NAME, 'decode')}",
                        "--replicas=3")
    e2e.wait_ready(decode=3)
    print(f"[e2e] third decode group Ready {elapsed(t0)} after kubectl scale")
    new = set(e2e.groups("decode")) - before
    assert len(new) == 1, (before, new)
    leader = next(p for p in e2e.rank0_pods("decode") if p["metadata"]["labels"][names.LABEL_GROUP] in new)
    address = f"{leader['status']['podIP']}:{names.WORKER_PORT}"
    wait_until(lambda: address in {r.get("address") for r in e2e.etcd_records()}, timeout=20,
               what=f"the new group's worker {address} in etcd")
    name = leader["metadata"]["name"]
    start = e2e.stats()[name].num_requests
    base = e2e.open_frontend()
    model = served_model(base)
    routed_before = _frontend_metric(e2e, "splitserve_router_decisions_total", leg="decode", winner=name)
    tally = Tally()
    for prompt, ref in fresh_cases:
        run_one(tally, base, model, prompt, ref)
    assert tally.failures == [] and tally.exact == 6, tally.failures
    # Not an exact share: on idle groups with no overlap the kv policy's tie-break is the fewest
    # cached blocks (router/policies/kv.py), which depends on what earlier tests left in each
    # cache. Whatever it is, six new prompts (4 blocks each with the answer) in turn reach every
    # group the router knows.
    routed = _frontend_metric(e2e, "splitserve_router_decisions_total", leg="decode", winner=name) - routed_before
    assert routed >= 1, routed
    assert e2e.stats()[name].num_requests - start >= routed     # and readiness canaries, if one ran meanwhile
    _assert_no_leaks(e2e)


def test_deleting_a_decode_rank0_pod_under_16_streams_migrates_them_token_exact(e2e: E2EDeployment, long_cases):
    base = e2e.open_frontend()
    model = served_model(base)
    migrated_before = _frontend_metric(e2e, "splitserve_migrations_total", outcome="migrated")
    tally, started = Tally(), threading.Semaphore(0)
    flags = [False] * 16

    def first_tokens(i: int):
        def seen(n: int) -> None:
            if n >= 2 and not flags[i]:
                flags[i] = True
                started.release()
        return seen

    threads = [threading.Thread(target=run_one, args=(tally, base, model, *long_cases[i % 4], first_tokens(i)),
                                daemon=True) for i in range(16)]
    for t in threads:
        t.start()
    for _ in range(16):
        assert started.acquire(timeout=120), tally.summary()
    stats = e2e.stats()
    victim = max(e2e.rank0_pods("decode"), key=lambda p: stats[p["metadata"]["name"]].num_running)
    victim_group = victim["metadata"]["labels"][names.LABEL_GROUP]
    running = stats[victim["metadata"]["name"]].num_running
    assert running > 0, {n: s.num_running for n, s in stats.items()}
    t0 = time.monotonic()
    e2e.cluster.kubectl("-n", e2e.namespace, "delete", "pod", victim["metadata"]["name"], "--wait=false")
    for t in threads:
        t.join(180)
    print(f"[e2e] pod delete under 16 streams ({running} on the victim): {tally.summary()}, {elapsed(t0)}")
    assert tally.failures == [] and tally.sent == tally.completed == tally.exact == 16, tally.failures
    assert _frontend_metric(e2e, "splitserve_migrations_total", outcome="migrated") - migrated_before >= running
    e2e.wait_ready(decode=3)                        # the group replaced as a unit
    assert victim_group not in e2e.groups("decode")
    print(f"[e2e] group {victim_group} replaced {elapsed(t0)} after the delete")
    # Through its SIGTERM: rank 0 drained (its rank 1 kept serving it), then handed its
    # streams over; the group was never torn down under it.
    log = e2e.agent.finished_log(e2e.namespace, victim["metadata"]["name"])
    assert "drain timeout; failing them so their frontends migrate them" in log, log[-3000:]
    assert "the group is lost" not in log, log[-3000:]
    _assert_no_leaks(e2e)


def test_scale_down_under_load_drains_the_victim_with_zero_failures(e2e: E2EDeployment, cases):
    base = e2e.open_frontend()
    load = Load(base, served_model(base), cases, concurrency=4).start()
    wait_until(lambda: load.tally.completed >= 8, timeout=60, what="the load to be flowing")
    t0 = time.monotonic()
    before = set(e2e.groups("decode"))
    e2e.cluster.kubectl("-n", e2e.namespace, "scale", f"servingpool/{names.pool_resource_name(SD_NAME, 'decode')}",
                        "--replicas=2")
    wait_until(lambda: len(e2e.groups("decode")) == 2, timeout=150, what="the victim group's pods to be gone")
    e2e.wait_ready(decode=2)
    tally = load.stop()
    (victim,) = before - set(e2e.groups("decode"))
    print(f"[e2e] scale-down 3 -> 2 under load: {tally.summary()}, victim {victim} gone in {elapsed(t0)}")
    assert tally.failures == [] and tally.completed == tally.exact == tally.sent > 8, tally.failures
    drained = e2e.api.event_messages(SD_NAME, "Drained")
    assert any(victim in m for m in drained), e2e.api.events(SD_NAME)
    _assert_no_leaks(e2e)


def test_rolling_update_under_load_zero_failures_never_zero_ready(e2e: E2EDeployment, cases):
    base = e2e.open_frontend()
    load = Load(base, served_model(base), cases, concurrency=4).start()
    wait_until(lambda: load.tally.completed >= 8, timeout=60, what="the load to be flowing")
    old = set(e2e.groups("decode"))
    t0 = time.monotonic()
    e2e.apply(decode_replicas=2, decode_engine_args=[*ENGINE_ARGS, "--max-num-seqs", "32"])
    least_ready = 2

    def rolled() -> bool:
        nonlocal least_ready
        least_ready = min(least_ready, len(e2e.rank0_pods("decode")))
        groups = e2e.groups("decode")
        return not (set(groups) & old) and len(e2e.rank0_pods("decode")) == 2
    wait_until(rolled, timeout=300, what="every decode group replaced by one of the new spec", interval=0.2)
    e2e.wait_ready(decode=2)
    tally = load.stop()
    print(f"[e2e] rolling update of 2 decode groups under load: {tally.summary()}, fewest ready decode "
          f"groups {least_ready}, {elapsed(t0)}")
    assert tally.failures == [] and tally.completed == tally.exact == tally.sent > 8, tally.failures
    assert least_ready >= 1
    for pod in e2e.api.pods(SD_NAME, "decode"):
        assert pod["spec"]["containers"][0]["args"][-2:] == ["--max-num-seqs", "32"]
    _assert_no_leaks(e2e)


def test_a_prefill_pool_at_zero_serves_on_the_decode_groups_and_comes_back(e2e: E2EDeployment, cases, llama_dir: Path):
    """The aggregated mode of `spec.autoscaling.switchModes` is the prefill ServingPool at 0
    groups: the planner scales it there, as `kubectl scale` does here. Under load, the prefill
    group drains with no request lost; the decode groups then prefill their own prompts (the
    router sends a request no prefill worker when none is registered); then it comes back."""
    pool = f"servingpool/{names.pool_resource_name(SD_NAME, 'prefill')}"
    base = e2e.open_frontend()
    model = served_model(base)
    load = Load(base, model, cases, concurrency=4).start()
    wait_until(lambda: load.tally.completed >= 8, timeout=60, what="the load to be flowing")
    t0 = time.monotonic()
    e2e.cluster.kubectl("-n", e2e.namespace, "scale", pool, "--replicas=0")
    wait_until(lambda: not e2e.groups("prefill"), timeout=150, what="the prefill group's pods to be gone")
    e2e.wait_ready(decode=2, prefill=0)
    wait_until(lambda: not [r for r in e2e.etcd_records() if r.get("role") == "prefill"], timeout=20,
               what="no prefill worker left in etcd")
    tally = load.stop()
    print(f"[e2e] prefill pool 1 -> 0 under load: {tally.summary()}, {elapsed(t0)}")
    assert tally.failures == [] and tally.completed == tally.exact == tally.sent > 8, tally.failures

    # Prompts no other test sends, so no worker holds a block of them: the decode workers compute each whole.
    prompts = [random_prompt(400 + i, 40) for i in range(4)]
    new_cases = list(zip(prompts, hf_greedy(llama_dir, prompts, SHORT, ignore_eos=True)))
    before = e2e.stats()
    assert set(before) == {p["metadata"]["name"] for p in e2e.rank0_pods("decode")}, sorted(before)
    tally = Tally()
    for prompt, ref in new_cases:
        run_one(tally, base, model, prompt, ref)
    assert tally.failures == [] and tally.exact == len(new_cases), tally.failures
    after = e2e.stats()
    computed = sum(after[n].num_prompt_tokens_computed - before[n].num_prompt_tokens_computed for n in before)
    assert computed >= 4 * 40, computed

    t0 = time.monotonic()
    e2e.cluster.kubectl("-n", e2e.namespace, "scale", pool, "--replicas=1")
    e2e.wait_ready(decode=2, prefill=1)
    print(f"[e2e] prefill pool back at 1 group Ready {elapsed(t0)} after kubectl scale")
    (leader,) = e2e.rank0_pods("prefill")
    address = f"{leader['status']['podIP']}:{names.WORKER_PORT}"
    wait_until(lambda: address in {r.get("address") for r in e2e.etcd_records()}, timeout=20,
               what=f"the new prefill worker {address} in etcd")
    before = e2e.stats()[leader["metadata"]["name"]].num_prefills_served
    # New prompts (seeds no test used): with threshold 0, every one is prefilled remotely again.
    fresh = [(random_prompt(300 + i, 40), None) for i in range(2)]
    for prompt, _ in fresh:
        assert len(stream(base, model, prompt, 4)) == 4
    assert e2e.stats()[leader["metadata"]["name"]].num_prefills_served - before == len(fresh)
    _assert_no_leaks(e2e)
