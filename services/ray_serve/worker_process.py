"""A vLLM worker replica's worker: `splitserve worker --engine vllm` as the replica's child process.

vLLM cannot be imported in splitserve's environment (docs/engines.md: its own pins), and the
replica actor runs with the driver's python. So the replica starts the worker with the vLLM
engine environment's python, exactly as `splitserve serve --engine vllm` does, listening on the
node's IP, and is ready when the worker's gRPC health says SERVING. Why not Ray's
`runtime_env` with the engine python (`py_executable`): the actor would have to import Ray and
splitserve's Serve code in the engine environment, which has neither Ray nor splitserve's
dependencies (fastapi>=0.165 against vLLM's fastapi<0.137).

The child dies with the actor: it is started with PR_SET_PDEATHSIG=SIGKILL from the replica's
event-loop thread (the signal follows the thread that forked, and that thread lives as long as
the actor), in a process group of its own. A killed actor therefore kills the worker and its
streams (the frontend migrates them), like a killed in-process worker. Serve's graceful stop
drains the worker over gRPC (worker_control.py) and then sends it SIGTERM.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading

from splitserve.net import free_port

from splitserve.services.ray_serve import worker_control
from splitserve.services.ray_serve.settings import WorkerSettings

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 20.0
TAIL_LINES = 60


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the forking thread (the replica's) ends."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG


def engine_python(settings: WorkerSettings) -> str:
    from splitserve.services.engine_vllm.environment import check_engine_python, default_engine_python

    return check_engine_python(settings.engine.engine_python or default_engine_python())


def worker_argv(settings: WorkerSettings, worker_id: str, host: str, port: int) -> list[str]:
    """`splitserve worker --engine vllm` for one replica (python and `-m splitserve` excluded)."""
    from splitserve.services.engine_vllm.environment import resolve_vllm_model

    e = settings.engine
    argv = ["worker", "--engine", "vllm", "--role", settings.role, "--host", host, "--port", str(port),
            "--worker-id", worker_id, "--drain-timeout", str(settings.drain_timeout_s),
            "--model", resolve_vllm_model(e.model), "--device", e.device, "--dtype", e.dtype,
            "--tp", str(settings.tensor_parallel), "--kv-cache-gib", str(e.kv_cache_gib),
            "--max-num-batched-tokens", str(e.max_num_batched_tokens), "--max-num-seqs", str(e.max_num_seqs)]
    if e.block_size is not None:
        argv += ["--block-size", str(e.block_size)]
    if settings.otlp_traces_endpoint:
        argv += ["--otlp-traces-endpoint", settings.otlp_traces_endpoint]
    return [*argv, "--", *e.engine_args]


def worker_env(settings: WorkerSettings) -> dict[str, str]:
    """The child's environment: this replica's, unbuffered, and the spec's weights revision."""
    from splitserve.checkpoints.fingerprint import REVISION_ENV

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if settings.engine.weights_revision:
        env[REVISION_ENV] = settings.engine.weights_revision
    return env


class WorkerProcess:
    """`splitserve worker --engine vllm` as this replica's child; the same surface as WorkerThread."""

    def __init__(self, settings: WorkerSettings, worker_id: str, host: str):
        self.worker_id = worker_id
        self.port = free_port(host)
        self.address = f"{host}:{self.port}"
        argv = [engine_python(settings), "-m", "splitserve", *worker_argv(settings, worker_id, host, self.port)]
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                                        start_new_session=True, env=worker_env(settings))
        threading.Thread(target=self._copy_output, name=f"worker {worker_id} output", daemon=True).start()
        log.info("worker %s: started %s (pid %d)", worker_id, " ".join(argv), self.process.pid)

    def _copy_output(self) -> None:
        """The worker's log into the replica's (Ray's log files), keeping a tail for errors."""
        for line in self.process.stdout:
            self.tail.append(line)
            sys.stderr.write(line)

    @property
    def error(self) -> str | None:
        code = self.process.poll()
        return None if code is None else f"exit code {code}; last output:\n{''.join(self.tail)}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_serving(self, timeout: float) -> None:
        worker_control.wait_serving(self.address, self.worker_id, self.alive, lambda: str(self.error), timeout)

    def drain(self, timeout: float) -> int:
        return worker_control.drain(self.address, self.worker_id, timeout)

    def num_in_flight(self) -> int:
        return worker_control.num_in_flight(self.address)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
