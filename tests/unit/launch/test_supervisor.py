"""The supervisor of `splitserve serve`'s children: restart with doubling back-off, the restart
count in the child's environment, a hung worker killed after its failed health checks."""

from __future__ import annotations

import sys
import time

from splitserve.services.launch import supervisor as sv
from splitserve.services.launch.supervisor import Supervisor


def _wait_exit(child, timeout: float = 10.0) -> None:
    child.process.wait(timeout)


def test_an_exited_child_restarts_with_doubling_backoff_and_its_restart_count(tmp_path):
    lines: list[str] = []
    out = tmp_path / "restarts"
    script = f"import os; open({str(out)!r}, 'a').write(os.environ.get('{sv.RESTARTS_ENV}', '0') + ' '); raise SystemExit(3)"
    sup = Supervisor(lines.append)
    try:
        child = sup.spawn("decode-0", [sys.executable, "-c", script])
        _wait_exit(child)
        t0 = time.monotonic()
        sup.supervise(t0)
        assert child.restart_at == t0 + sv.RESTART_BACKOFF_FIRST
        assert "decode-0 exited with code 3; restarting it in 0.5 s (restart 1" in lines[-1]
        sup.supervise(t0 + 0.1)                        # not yet
        assert child.restarts == 0
        sup.supervise(t0 + sv.RESTART_BACKOFF_FIRST)
        assert child.restarts == 1 and "decode-0 restarted" in lines[-1]
        _wait_exit(child)
        t1 = child.started + 1.0                       # crashed again soon after: twice the wait
        sup.supervise(t1)
        assert child.restart_at == t1 + 2 * sv.RESTART_BACKOFF_FIRST
        sup.supervise(child.restart_at)
        _wait_exit(child)
        assert out.read_text().split() == ["0", "1", "2"]
        # Up longer than RESTART_RESET_S before crashing: back to the first back-off.
        late = child.started + sv.RESTART_RESET_S + 1
        sup.supervise(late)
        assert child.restart_at == late + sv.RESTART_BACKOFF_FIRST
    finally:
        sup.stop()


def test_a_worker_failing_its_health_checks_is_killed_and_restarted():
    lines: list[str] = []
    sup = Supervisor(lines.append, start_timeout_s=0.0)
    try:
        # A "worker" whose gRPC port never answers: hung, not dead.
        child = sup.spawn("decode-1", [sys.executable, "-c", "import time; time.sleep(60)"], address="127.0.0.1:9")
        child.serving = True
        now = time.monotonic()
        for i in range(sv.CANARY_FAILURES):
            child.canary_at = 0.0
            sup.supervise(now + i)
        assert child.process.poll() is not None            # killed
        assert any("failed 3 health checks in a row; killing it" in line for line in lines), lines
        assert child.restart_at is not None
    finally:
        sup.stop()


def test_a_draining_worker_is_left_to_finish_its_drain_not_killed():
    """A worker that answers its health check NOT_SERVING after serving was sent SIGTERM from
    outside serve (a drain): it is not killed as a failing one until RETIRE_KILL_S has passed."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    lines: list[str] = []
    sup = Supervisor(lines.append, start_timeout_s=0.0)
    try:
        child = sup.spawn("worker-1", [sys.executable, "-c", "import time; time.sleep(60)"],
                          address=f"127.0.0.1:{port}")
        child.serving = True
        now = time.monotonic()
        for i in range(sv.CANARY_FAILURES + 2):
            child.canary_at = 0.0
            sup.supervise(now + i)
        assert child.process.poll() is None and child.restart_at is None        # still draining
        assert lines == ["splitserve: worker-1 is draining; it restarts once it exits"]
        server.stop(0)                    # its drain ended: the server stops, the process exits soon
        for i in range(sv.CANARY_FAILURES):
            child.canary_at = 0.0
            sup.supervise(now + 10 + i)
        assert child.process.poll() is None and child.restart_at is None
        later = now + sv.RETIRE_KILL_S
        for i in range(sv.CANARY_FAILURES):
            child.canary_at = 0.0
            sup.supervise(later + i)
        assert child.process.poll() is not None and child.restart_at is not None  # drained too long
        assert any("failed 3 health checks in a row; killing it" in line for line in lines), lines
    finally:
        sup.stop()
        server.stop(0)
