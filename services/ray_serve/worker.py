"""A prefill or decode worker as a Ray Serve replica: the existing worker, in-process.

The replica actor *is* the worker: its constructor runs `splitserve worker`'s
own gRPC server (services/worker/server.py, engine, KV connector, KV-event
stream) on a thread with its own event loop, listening on the node's IP, and
returns only once that server reports SERVING, so Serve counts the replica
ready exactly when it can take work. Nothing reaches the worker through Ray's
request path: the ingress talks to it over its gRPC API like any frontend,
and it is found through the directory (directory.py), to which the replica
renews a lease every second. Killing the replica's actor therefore kills the
worker and its streams (the frontend migrates them); Serve replaces it.
Serve's graceful stop (scale-down, redeploy, delete) drains instead: the
worker refuses new work, its running calls finish (up to the spec's drain
timeout), then it gives its lease back and stops.

A vLLM pool's replica runs the worker as its child process instead, with the vLLM
engine environment's python (worker_process.py says why and how it dies with the actor).

A tensor-parallel worker's extra ranks are the engine's own spawned processes
(services/engine/parallel/tensor_parallel.py); the replica's placement group (one
bundle per rank, STRICT_PACK: app.py) reserves their CPUs and GPUs on the
same node.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

from splitserve.errors import SplitserveError
from splitserve.net import free_port

from splitserve.services.ray_serve import worker_control
from splitserve.services.ray_serve.autoscaling import IN_FLIGHT_METRIC
from splitserve.services.ray_serve.directory import LEASE_RENEW_S, DirectoryEntry
from splitserve.services.ray_serve.settings import WorkerSettings

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 10.0


def _server_config(settings: WorkerSettings, worker_id: str, host: str, port: int):
    from splitserve.services.engine.builtin import BuiltinEngineLauncher
    from splitserve.services.engine.config import EngineConfig
    from splitserve.services.worker.server import WorkerServerConfig
    from splitserve.services.worker.service import Role, WorkerOptions

    e = settings.engine
    engine = EngineConfig(model=e.model, device=e.device, dtype=e.dtype,
                          tensor_parallel_size=settings.tensor_parallel, block_size=e.block_size or 16,
                          kv_cache_gib=e.kv_cache_gib, max_num_batched_tokens=e.max_num_batched_tokens,
                          max_num_seqs=e.max_num_seqs, num_threads=e.threads, weights_revision=e.weights_revision)
    options = WorkerOptions(worker_id=worker_id, role=Role(settings.role),
                            remote_prefill_threshold=settings.remote_prefill_threshold,
                            prefill_timeout_s=settings.prefill_timeout_s)
    options.otlp_traces_endpoint = settings.otlp_traces_endpoint
    return WorkerServerConfig(options=options, engine=BuiltinEngineLauncher(engine), host=host, port=port,
                              transfer=settings.transfer)


class WorkerThread:
    """`splitserve worker`'s server on a thread of this process, stopped through `stop()`."""

    def __init__(self, settings: WorkerSettings, worker_id: str, host: str):
        self.port = free_port(host)
        self.address = f"{host}:{self.port}"
        self._config = _server_config(settings, worker_id, host, self.port)
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"worker {worker_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from splitserve.services.worker.server import serve

        asyncio.set_event_loop(self._loop)
        try:
            self._stop = asyncio.Event()
            self._loop.run_until_complete(serve(self._config, self._stop, handle_signals=False))
        except BaseException as exc:  # noqa: BLE001 - reported through alive()/error
            self.error = exc
            log.exception("worker %s failed", self._config.options.worker_id)
        finally:
            self._loop.close()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def wait_serving(self, timeout: float = READY_TIMEOUT_S) -> None:
        worker_control.wait_serving(self.address, self._config.options.worker_id, self.alive,
                                    lambda: repr(self.error), timeout)

    def drain(self, timeout: float) -> int:
        return worker_control.drain(self.address, self._config.options.worker_id, timeout)

    def num_in_flight(self) -> int:
        return worker_control.num_in_flight(self.address)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        if self._stop is not None and self.alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)


class WorkerReplica:
    """The Serve deployment class of both pools (app.py names and sizes each pool)."""

    async def __init__(self, settings: WorkerSettings, directory) -> None:
        import ray
        from ray import serve

        context = serve.get_replica_context()
        self.worker_id = f"{settings.role}-{context.replica_id.unique_id}"
        self.settings = settings
        self.directory = directory
        host = ray.util.get_node_ip_address()
        if settings.engine.engine == "vllm":
            from splitserve.services.ray_serve.worker_process import WorkerProcess

            # Started on this (the replica's event-loop) thread: its death signal follows the thread.
            self.worker: WorkerThread | WorkerProcess = WorkerProcess(settings, self.worker_id, host)
        else:
            self.worker = WorkerThread(settings, self.worker_id, host)
        await asyncio.to_thread(self.worker.wait_serving, READY_TIMEOUT_S)
        runtime = ray.get_runtime_context()
        self.entry = DirectoryEntry(self.worker_id, settings.role, self.worker.address,
                                    runtime.get_actor_name() or runtime.get_actor_id(), os.getpid())
        await self.directory.renew.remote(self.entry)
        # On the replica's event loop: Serve handles may only be used from one (in some modes).
        self._lease: asyncio.Task | None = asyncio.create_task(self._renew(), name="directory lease")
        log.info("worker replica %s (%s) serving at %s", self.worker_id, settings.role, self.worker.address)

    async def _renew(self) -> None:
        """Renew the directory lease every LEASE_RENEW_S until shutdown cancels this task."""
        while True:
            await asyncio.sleep(LEASE_RENEW_S)
            try:
                await asyncio.wait_for(self.directory.renew.remote(self.entry), 5)
            except Exception as exc:  # noqa: BLE001 - the directory may be restarting; retry
                log.warning("worker %s: directory lease renewal failed: %r", self.worker_id, exc)

    def check_health(self) -> None:
        """Serve's periodic health check: a worker whose server thread ended is replaced."""
        if not self.worker.alive():
            raise SplitserveError(f"worker {self.worker_id} stopped: {self.worker.error!r}")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics hook (autoscaling.py reads it)."""
        return {IN_FLIGHT_METRIC: float(await asyncio.to_thread(self.worker.num_in_flight))}

    def describe(self) -> DirectoryEntry:
        return self.entry

    async def __del__(self) -> None:
        """Serve's graceful shutdown (scale-down, redeploy, delete): drain, give the lease
        back, stop the worker server. The lease is kept while draining: releasing it makes
        the routers drop the worker and close their channels, which would break its streams."""
        lease = getattr(self, "_lease", None)
        if lease is None:
            return
        left = await asyncio.to_thread(self.worker.drain, self.settings.drain_timeout_s)
        if left:
            log.warning("worker %s: %d calls still running after the %.0f s drain timeout", self.worker_id,
                        left, self.settings.drain_timeout_s)
        lease.cancel()
        try:
            await asyncio.wait_for(self.directory.release.remote(self.worker_id), 1)
        except Exception as exc:  # noqa: BLE001 - best effort: the lease expires anyway
            log.warning("worker %s: directory release failed: %r", self.worker_id, exc)
        await asyncio.to_thread(self.worker.stop)
