"""`serve --autoscale`'s pieces without a model: its flags, the workers' and frontends' command lines,
the supervisor's retire (drain) path, the profile's decode arithmetic, and the shared control loop
(services/autoscaling) applying the planner's counts to (stand-in) worker processes
(autoscale_thread.py, local_scaling.py, local_metrics.py)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
import types

import pytest

from splitserve.errors import SplitserveError
from splitserve.services.cli.parsers import build_parser
from splitserve.services.launch import membership
from splitserve.services.launch import supervisor as sv
from splitserve.services.planner.readings import FrontendCounters, Reading, WorkerCounters
from splitserve.services.launch.autoscale_thread import LocalAutoscaler, local_autoscaler, planner_config
from splitserve.services.launch.children import frontend_argv, worker_argv
from splitserve.services.launch.local_metrics import LocalMetricsSource
from splitserve.services.launch.local_scaling import (DRAINING, SERVING, STARTING, LocalWorkers, ScaledWorker,
                                                      WorkerLauncher)
from splitserve.services.launch.topology import (AutoscaleSettings, autoscale_settings, plan_workers, process_role,
                                             worker_slots)
from splitserve.services.launch.profile_run import decode_step_seconds
from splitserve.services.launch.supervisor import Supervisor
from splitserve.services.planner import CapacityProfile, PlannerMode, ReplicaCounts, ThroughputCurve
from splitserve.testing.processes import ignores_signal
from splitserve.testing.waiting import wait_until

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


# -- flags -------------------------------------------------------------------------------------
def test_defaults_fill_in_with_autoscale():
    args = _serve_args("--aggregated", "--autoscale")
    s = autoscale_settings(args, plan_workers(args))
    assert s == AutoscaleSettings(max_workers=4, ttft_p90_s=1.0, itl_p90_s=0.1, interval_s=10.0, cooldown_s=120.0)
    args = _serve_args("--aggregated", "--autoscale", "--max-workers", "3", "--slo-ttft-p90-ms", "500",
                       "--slo-itl-p90-ms", "40", "--autoscale-interval", "2", "--autoscale-cooldown", "6")
    assert autoscale_settings(args, plan_workers(args)) == AutoscaleSettings(3, 0.5, 0.04, 2.0, 6.0)
    assert autoscale_settings(_serve_args(), plan_workers(_serve_args())) is None


@pytest.mark.parametrize("argv, message", [
    (["--max-workers", "3"], "--max-workers only applies with --autoscale"),
    (["--slo-ttft-p90-ms", "100", "--autoscale-interval", "2"],
     "--slo-ttft-p90-ms, --autoscale-interval only apply with --autoscale"),
    (["--aggregated", "--workers", "3", "--autoscale", "--max-workers", "2"], "below the workers serve starts with"),
    (["--autoscale", "--max-workers", "1"], "disaggregated serving needs at least 2"),
    (["--autoscale", "--slo-itl-p90-ms", "0"], "must be > 0"),
    (["--autoscale", "--autoscale-interval", "0"], "--autoscale-interval must be > 0"),
])
def test_contradictory_flags_are_refused(argv, message):
    args = _serve_args(*argv)
    with pytest.raises(SplitserveError, match=message):
        autoscale_settings(args, plan_workers(args))


def test_autoscale_on_ray_is_refused_before_anything_starts():
    from splitserve.services.cli.commands import cmd_serve

    with pytest.raises(SplitserveError, match="--autoscale .* does not apply with --on-ray"):
        cmd_serve(_serve_args("--autoscale", "--on-ray"))


def test_with_a_fixed_mode_the_planner_keeps_serves_mode_and_bounds():
    agg = planner_config(AutoscaleSettings(3, 1.0, 0.1, 2.0, 6.0, switch_modes=False), aggregated=True)
    assert agg.mode is PlannerMode.AGGREGATED and agg.aggregated.max_replicas == 3 and agg.max_workers == 3
    assert agg.cooldown_s == 6.0
    split = planner_config(AutoscaleSettings(4, 1.0, 0.1, 2.0, 6.0, switch_modes=False), aggregated=False)
    assert split.mode is PlannerMode.DISAGGREGATED
    assert (split.prefill.min_replicas, split.prefill.max_replicas, split.decode.max_replicas) == (1, 3, 3)


def test_slots_pad_the_plan_to_max_workers():
    plan = plan_workers(_serve_args("--aggregated"))
    slots = worker_slots(plan, 3)
    assert [s.name for s in slots] == ["worker-0", "slot-1", "slot-2"]


# -- command lines -----------------------------------------------------------------------------
def test_with_etcd_workers_register_and_frontends_follow_it_instead_of_a_list():
    args = _serve_args("--aggregated", "--autoscale")
    args.threads = 1
    plan = plan_workers(args)
    w = worker_argv(args, "worker-3", "both", 5000, "m", None, None, "127.0.0.1:2379")
    assert w[w.index("--etcd") + 1] == "127.0.0.1:2379" and w[w.index("--worker-id") + 1] == "worker-3"
    f = frontend_argv(args, "m", "127.0.0.1", 8000, 8001, ["127.0.0.1:5000"], plan, "127.0.0.1:2379")
    assert f[f.index("--etcd") + 1] == "127.0.0.1:2379" and "--worker" not in f
    static = frontend_argv(args, "m", "127.0.0.1", 8000, 8001, ["127.0.0.1:5000"], plan)
    assert "--etcd" not in static and static[static.index("--worker") + 1] == "both=127.0.0.1:5000"


def test_a_missing_etcd_binary_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(membership.shutil, "which", lambda name: None)
    with pytest.raises(SplitserveError, match="--autoscale needs the etcd binary"):
        membership.LocalEtcd.plan()


def test_the_local_etcd_listens_on_loopback_only():
    etcd = membership.LocalEtcd("/usr/bin/etcd", "/tmp/x", 2379, 2380)
    argv = etcd.argv()
    assert etcd.endpoint == "127.0.0.1:2379"
    assert argv[argv.index("--listen-client-urls") + 1] == "http://127.0.0.1:2379"
    assert argv[argv.index("--listen-peer-urls") + 1] == "http://127.0.0.1:2380"


# -- the supervisor ----------------------------------------------------------------------------
def test_a_retired_worker_is_signalled_not_restarted_and_reaped_once_gone():
    lines: list[str] = []
    sup = Supervisor(lines.append)
    try:
        child = sup.spawn("worker-1", SLEEPER, "127.0.0.1:9", starting=True)
        assert not child.serving                        # not canaried while it loads
        sup.retire(child)
        assert child not in sup.children and child.retired_at is not None
        child.process.wait(10)
        assert child.process.returncode == -15          # SIGTERM
        sup.supervise()                                 # not restarted: no longer supervised
        assert child.restarts == 0 and child.restart_at is None
        assert sup.reap_retired() == [child] and sup.reap_retired() == []
    finally:
        sup.stop()


def test_a_retired_worker_that_outlives_its_drain_is_killed():
    lines: list[str] = []
    sup = Supervisor(lines.append)
    try:
        ignore = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                        "time.sleep(60)"]
        child = sup.spawn("worker-1", ignore, "127.0.0.1:9")
        wait_until(lambda: ignores_signal(child.process.pid, signal.SIGTERM), timeout=30, interval=0.02,
                   what="the child to ignore SIGTERM")
        sup.retire(child)
        assert sup.reap_retired() == []
        # Past the kill time by a margin: (t + K) - t can round below K for some clock values.
        assert sup.reap_retired(child.retired_at + sv.RETIRE_KILL_S + 1.0) == [child]
        assert child.process.returncode == -9 and "still running" in lines[-1]
    finally:
        sup.stop()


def test_an_own_group_child_stops_after_the_others():
    sup = Supervisor(lambda line: None)
    worker = sup.spawn("worker-0", SLEEPER, "127.0.0.1:9")
    etcd = sup.spawn("etcd", SLEEPER, own_group=True)
    import os
    assert os.getpgid(etcd.process.pid) != os.getpgid(worker.process.pid)
    sup.stop()
    assert worker.process.returncode is not None and etcd.process.returncode is not None


# -- the profile -------------------------------------------------------------------------------
def test_decode_step_is_measured_while_every_stream_decodes():
    # Two streams, one token every 10 ms each, the second starting 50 ms later.
    a = [(0.00 + 0.01 * i, 1) for i in range(30)]
    b = [(0.05 + 0.01 * i, 1) for i in range(30)]
    step = decode_step_seconds(2, [a, b])
    assert step == pytest.approx(0.01, rel=0.1)
    assert decode_step_seconds(1, [[(0.0, 1)]]) is None
    assert decode_step_seconds(2, [a, []]) is None


# -- the control loop, on stand-in workers -----------------------------------------------------
PROFILE = CapacityProfile(ThroughputCurve(((64, 4000.0), (1024, 8000.0))), ThroughputCurve(((1, 50.0), (16, 400.0))),
                          startup_s=1.0, kv_capacity_tokens=100_000)


class _FedReadings(LocalMetricsSource):
    """The scrape with readings fed by the test (no frontend, no worker Stats)."""

    def __init__(self, say):
        super().__init__([], lambda: [], say)
        self.readings: list[Reading] = []

    def read(self):
        return self.readings.pop(0)


def _fed_scaler(sup: Supervisor, say, settings: AutoscaleSettings, aggregated: bool, profile: CapacityProfile,
                launcher: WorkerLauncher, workers: list[ScaledWorker]) -> LocalAutoscaler:
    """serve's autoscaler with readings fed by the test (`.loop.source.readings`) and no probes."""
    source = _FedReadings(say)
    actuator = LocalWorkers(sup, say, settings, aggregated, launcher, workers,
                            last_reading=lambda: source.last_reading)
    return LocalAutoscaler(actuator, source, say, settings, profile)


def run(coro):
    return asyncio.run(coro)


def _tick(auto: LocalAutoscaler):
    """One interval of the shared loop (the first: the baseline, as serve's first step)."""
    return run(auto.loop.interval())


def _reading(t: float, ended: int, prompt: int, ttft_slow: int = 0) -> Reading:
    inf = float("inf")
    return Reading(t, FrontendCounters(ended=ended, ended_ok=ended, prompt_tokens=ended * prompt,
                                       generation_tokens=ended * 4,
                                       ttft_buckets=((0.5, ended - ttft_slow), (inf, ended))),
                   (WorkerCounters("worker-0", "both"),))


def test_the_loop_starts_a_worker_for_a_step_and_drains_one_after_the_cooldown():
    lines: list[str] = []
    sup = Supervisor(lines.append)
    started: list[tuple[str, str, int]] = []

    def argv(name, role, port, cores):
        started.append((name, role, port))
        return SLEEPER

    try:
        first = sup.spawn("worker-0", SLEEPER, "127.0.0.1:9")
        launcher = WorkerLauncher(sup, argv, [None, None])
        auto = _fed_scaler(sup, lines.append, AutoscaleSettings(2, 1.0, 0.5, 1.0, 3.0), True, PROFILE, launcher,
                           [ScaledWorker("worker-0", 0, "both", 0, first)])
        scaler, readings = auto.actuator, auto.loop.source.readings
        # 1 request/s of 1024-token prompts is an eighth of a worker; 7/s needs two.
        total, t = 0, 100.0
        readings.append(_reading(t, total, 1024))
        assert _tick(auto) is None                                # the baseline
        for _ in range(3):
            t, total = t + 1, total + 1
            readings.append(_reading(t, total, 1024))
            assert _tick(auto).replicas == ReplicaCounts.of_aggregated(1)
        t, total = t + 1, total + 7
        readings.append(_reading(t, total, 1024))
        decision = _tick(auto)
        assert decision.replicas == ReplicaCounts.of_aggregated(2), decision.explain()
        # In auto mode a decode process, counted in the aggregated pool (plan.process_role).
        assert [(n, r) for n, r, _ in started] == [("worker-1", "decode")]
        new = scaler.workers[-1]
        assert (new.name, new.role, new.state, new.slot) == ("worker-1", "both", STARTING, 1)
        assert any(line.startswith("autoscale: planner: 1A -> 2A") for line in lines)
        new.state = SERVING                                       # (the probe's part)
        # Quiet: after the 3 s cool-down the pool shrinks; worker-1 (the newest, both idle) drains.
        for _ in range(8):
            t += 1
            readings.append(_reading(t, total, 1024))
            _tick(auto)
            if any(w.state == DRAINING for w in scaler.workers):
                break
        assert scaler.asked() == ReplicaCounts.of_aggregated(1)
        leaving = next(w for w in scaler.workers if w.state == DRAINING)
        assert leaving.name == "worker-1" and leaving.child in sup.retired
        leaving.child.process.wait(10)
        scaler.housekeeping()
        assert [w.name for w in scaler.workers] == ["worker-0"]
        assert any("worker-1 drained and stopped" in line for line in lines), lines
    finally:
        sup.stop()


def test_the_thread_runs_the_loop_and_an_interval_that_raises_is_one_line_not_the_end():
    lines: list[str] = []
    sup = Supervisor(lines.append)
    done = threading.Event()

    class Failing(_FedReadings):
        def read(self):
            if not self.readings:
                done.set()
                raise RuntimeError("the scrape broke")
            return super().read()

    try:
        first = sup.spawn("worker-0", SLEEPER, "127.0.0.1:9")
        source = Failing(lines.append)
        source.readings += [_reading(100.0, 0, 64), _reading(101.0, 1, 64)]
        settings = AutoscaleSettings(2, 1.0, 0.5, 0.01, 3.0)
        actuator = LocalWorkers(sup, lines.append, settings, True, WorkerLauncher(sup, lambda *a: SLEEPER, [None]),
                                [ScaledWorker("worker-0", 0, "both", 0, first)])
        auto = LocalAutoscaler(actuator, source, lines.append, settings, PROFILE)
        auto.start()
        assert done.wait(30)
        auto.stop()
        assert not auto._thread.is_alive()
        assert auto.loop.num_decisions == 1 and auto.loop.last_decision.replicas == ReplicaCounts.of_aggregated(1)
        error = next(line for line in lines if line.startswith("autoscale: error"))
        assert "(the deployment keeps its workers)" in error and "RuntimeError: the scrape broke" in error
    finally:
        sup.stop()


def test_a_worker_that_never_serves_is_stopped_after_the_start_timeout():
    lines: list[str] = []
    sup = Supervisor(lines.append, start_timeout_s=5.0)
    try:
        first = sup.spawn("worker-0", SLEEPER, "127.0.0.1:9")
        scaler = _fed_scaler(sup, lines.append, AutoscaleSettings(2, 1.0, 0.5, 1.0, 3.0), True, PROFILE,
                             WorkerLauncher(sup, lambda *a: SLEEPER, [None, None]),
                             [ScaledWorker("worker-0", 0, "both", 0, first)]).actuator
        stuck = scaler._start("both")                  # its port never answers
        scaler.housekeeping(stuck.changed_at + 1.0)
        assert stuck.state == STARTING and scaler.asked() == ReplicaCounts.of_aggregated(2)
        scaler.housekeeping(stuck.changed_at + 6.0)
        assert stuck.state == DRAINING and stuck.child in sup.retired
        assert "worker-1 is not serving 5 s after its start" in lines[-1]
        assert scaler.asked() == ReplicaCounts.of_aggregated(1)
    finally:
        sup.stop()


def test_no_free_place_defers_a_start():
    lines: list[str] = []
    sup = Supervisor(lines.append)
    try:
        first = sup.spawn("worker-0", SLEEPER, "127.0.0.1:9")
        scaler = _fed_scaler(sup, lines.append, AutoscaleSettings(1, 1.0, 0.5, 1.0, 3.0), True, PROFILE,
                             WorkerLauncher(sup, lambda *a: SLEEPER, [None]),
                             [ScaledWorker("worker-0", 0, "both", 0, first)]).actuator
        assert scaler._start("both") is None and "no free place" in lines[-1]
    finally:
        sup.stop()


def test_read_sums_the_frontends_and_a_restarted_one_starts_a_new_baseline():
    import http.server
    import threading

    from splitserve.services.frontend.metrics import FrontendMetrics

    metrics = [FrontendMetrics(), FrontendMetrics()]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = metrics[self.server.index].exposition()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    servers = []
    for i in range(2):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.index = i
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    lines: list[str] = []
    sup = Supervisor(lines.append)
    try:
        first = sup.spawn("worker-0", SLEEPER, "127.0.0.1:9")
        auto = local_autoscaler(sup, lines.append, AutoscaleSettings(2, 1.0, 0.5, 1.0, 3.0), True, PROFILE,
                                WorkerLauncher(sup, lambda *a: SLEEPER, [None, None]),
                                [ScaledWorker("worker-0", 0, "both", 0, first)],
                                [f"http://127.0.0.1:{s.server_address[1]}" for s in servers])
        scaler = auto.loop.source
        def served(m: FrontendMetrics, count: int) -> None:      # admitted and ended (services/frontend/core.py)
            m.admitted.inc(count)
            m.requests.labels("completions", "ok").inc(count)

        for m in metrics:
            served(m, 3)
        reading = scaler.read()
        assert reading.frontend.ended == 6 and reading.workers == ()     # worker-0 answers no Stats
        assert _tick(auto) is None                                        # the baseline
        served(metrics[0], 2)
        assert _tick(auto).inputs.num_arrivals == 2
        metrics[1] = FrontendMetrics()                                    # frontend-1 restarted
        served(metrics[0], 1)
        assert _tick(auto) is None                                        # a new baseline, not a burst
        served(metrics[1], 1)
        assert _tick(auto).inputs.num_arrivals == 1
        servers[1].shutdown()
        servers[1].server_close()
        assert scaler.read() is None and "cannot read a frontend's /metrics" in lines[-1]
    finally:
        servers[0].shutdown()
        sup.stop()


# -- switching modes (--autoscale-mode auto) ---------------------------------------------------
def _asking(replicas: ReplicaCounts):
    """What apply() reads of a planner Decision: the counts it asks for."""
    return types.SimpleNamespace(replicas=replicas)


def _exit_retired(scaler: LocalWorkers) -> None:
    """The drained workers exit (the stand-ins end at SIGTERM) and housekeeping reaps them."""
    for w in scaler.workers:
        if w.state == DRAINING:
            w.child.process.wait(10)
    scaler.housekeeping()


def _serving(scaler: LocalWorkers) -> None:
    for w in scaler.workers:
        if w.state == STARTING:
            w.state = SERVING                           # (the probe's part)


def _can_decode(scaler: LocalWorkers) -> bool:
    return any(w.state == SERVING and w.role != "prefill" for w in scaler.workers)


def _three_aggregated(sup: Supervisor, lines: list[str], process_role: str = "") -> LocalAutoscaler:
    """Three aggregated workers in all of --max-workers 3's places; process_role "decode": as an
    `auto` start runs them (plan.process_role), "": `both` processes (a `fixed` start)."""
    children = [sup.spawn(f"worker-{i}", SLEEPER, "127.0.0.1:9") for i in range(3)]
    return _fed_scaler(sup, lines.append, AutoscaleSettings(3, 1.0, 0.5, 1.0, 3.0), True, PROFILE,
                       WorkerLauncher(sup, lambda *a: SLEEPER, [None, None, None]),
                       [ScaledWorker(c.name, i, "both", i, c, process_role=process_role)
                        for i, c in enumerate(children)])


def test_where_modes_may_switch_an_aggregated_worker_starts_as_a_decode_process():
    auto, fixed = AutoscaleSettings(3, 1.0, 0.1, 5.0, 30.0), AutoscaleSettings(3, 1.0, 0.1, 5.0, 30.0, False)
    assert [process_role(r, auto) for r in ("both", "prefill", "decode")] == ["decode", "prefill", "decode"]
    assert [process_role(r, fixed) for r in ("both", "prefill", "decode")] == ["both", "prefill", "decode"]
    assert process_role("both", AutoscaleSettings(1, 1.0, 0.1, 5.0, 30.0)) == "both"     # one place: no switch
    assert process_role("both", None) == "both"                                          # no --autoscale
    worker = ScaledWorker("worker-0", 0, "both", 0, None, process_role="decode")
    assert worker.can_serve_as("decode") and worker.can_serve_as("both") and not worker.can_serve_as("prefill")
    assert not ScaledWorker("worker-1", 1, "both", 1, None).can_serve_as("decode")


def test_auto_mode_lets_the_planner_switch_and_fixed_keeps_the_start_mode():
    assert planner_config(AutoscaleSettings(3, 1.0, 0.1, 5.0, 30.0), False).mode is PlannerMode.AUTO
    assert planner_config(AutoscaleSettings(3, 1.0, 0.1, 5.0, 30.0, switch_modes=False), False).mode \
        is PlannerMode.DISAGGREGATED
    # One place cannot hold a disaggregated deployment: aggregated it stays.
    assert planner_config(AutoscaleSettings(1, 1.0, 0.1, 5.0, 30.0), True).mode is PlannerMode.AGGREGATED
    args = _serve_args("--autoscale", "--autoscale-mode", "fixed")
    assert autoscale_settings(args, plan_workers(args)).switch_modes is False


def test_switching_to_aggregated_moves_the_decode_worker_in_place_and_replaces_the_prefill_worker():
    lines: list[str] = []
    sup = Supervisor(lines.append)
    try:
        p0 = sup.spawn("prefill-0", SLEEPER, "127.0.0.1:9")
        d0 = sup.spawn("decode-0", SLEEPER, "127.0.0.1:9")
        scaler = _fed_scaler(sup, lines.append, AutoscaleSettings(3, 1.0, 0.5, 1.0, 3.0), False, PROFILE,
                             WorkerLauncher(sup, lambda *a: SLEEPER, [None, None, None]),
                             [ScaledWorker("prefill-0", 0, "prefill", 0, p0),
                              ScaledWorker("decode-0", 0, "decode", 1, d0)]).actuator
        run(scaler.apply(_asking(ReplicaCounts.of_aggregated(3))))
        assert "switching to aggregated serving: decode-0 now serves in the aggregated pool in place" \
            in " ".join(lines)
        # decode-0 serves on as an aggregated worker; the free place takes a new one, and the
        # prefill worker drains for the third.
        assert {w.name: (w.role, w.state) for w in scaler.workers} == {
            "prefill-0": ("prefill", DRAINING), "decode-0": ("both", SERVING), "worker-0": ("both", STARTING)}
        assert scaler._running() == ReplicaCounts.of_aggregated(2) and _can_decode(scaler)
        assert scaler.asked() == ReplicaCounts.of_aggregated(3)       # what the planner reads
        _exit_retired(scaler)
        _serving(scaler)
        scaler.housekeeping()
        assert {w.name: (w.role, w.state) for w in scaler.workers} == {
            "decode-0": ("both", SERVING), "worker-0": ("both", SERVING), "worker-1": ("both", SERVING)}
        assert all(w.child not in sup.retired for w in scaler.workers)
    finally:
        sup.stop()


def test_switching_to_disaggregated_moves_the_aggregated_decode_processes_and_drains_one_for_a_prefill_worker():
    lines: list[str] = []
    sup = Supervisor(lines.append)
    try:
        scaler = _three_aggregated(sup, lines, process_role="decode").actuator
        run(scaler.apply(_asking(ReplicaCounts.of_pools(1, 2))))
        assert [(w.role, w.state) for w in scaler.workers].count(("decode", SERVING)) == 2
        assert [w.state for w in scaler.workers].count(DRAINING) == 1           # the surplus, for a place
        assert scaler.asked() == ReplicaCounts.of_pools(1, 2)
        assert "no free place for 1 more worker(s) yet" in lines[-1]            # the prefill worker waits
        _exit_retired(scaler)
        assert sorted((w.role, w.state) for w in scaler.workers) == [
            ("decode", SERVING), ("decode", SERVING), ("prefill", STARTING)]
    finally:
        sup.stop()


def test_switching_to_disaggregated_from_full_places_drains_one_at_a_time():
    lines: list[str] = []
    sup = Supervisor(lines.append)
    try:
        scaler = _three_aggregated(sup, lines).actuator
        run(scaler.apply(_asking(ReplicaCounts.of_pools(1, 2))))
        seen_capacity = []
        for _ in range(12):
            states = [w.state for w in scaler.workers]
            assert states.count(DRAINING) <= 1, scaler.workers      # one place at a time
            assert _can_decode(scaler), scaler.workers               # never without a worker that decodes
            seen_capacity.append(sum(s == SERVING for s in states))
            if sorted(w.role for w in scaler.workers) == ["decode", "decode", "prefill"] and states.count(DRAINING) == 0:
                break
            _exit_retired(scaler)
            _serving(scaler)
            scaler.housekeeping()
        assert sorted(w.role for w in scaler.workers) == ["decode", "decode", "prefill"], scaler.workers
        assert scaler.asked() == ReplicaCounts.of_pools(1, 2)
        assert not any("no free place" in line for line in lines)
    finally:
        sup.stop()


def test_in_a_switch_the_planner_reads_the_counts_asked_for_not_a_deployment_to_start():
    # All places full of aggregated processes (a `fixed` start cannot move them): no worker of
    # the new mode can start until an old one leaves, so none runs yet; the planner read that as
    # 0 workers and chose a mode from scratch.
    lines: list[str] = []
    sup = Supervisor(lines.append)
    try:
        auto = _three_aggregated(sup, lines)
        scaler = auto.actuator
        scaler.target = ReplicaCounts.of_aggregated(3)
        run(scaler.apply(_asking(ReplicaCounts.of_pools(1, 2))))
        assert scaler._running() == ReplicaCounts.of_pools(0, 0)
        assert scaler.asked() == ReplicaCounts.of_pools(1, 2)
        auto.loop.source.readings += [_reading(100.0, 0, 64), _reading(101.0, 1, 64)]
        assert _tick(auto) is None                                # the baseline
        decision = _tick(auto)
        assert decision.current == ReplicaCounts.of_pools(1, 2), decision.explain()
        assert not decision.mode_reason.startswith("start"), decision.explain()
    finally:
        sup.stop()
