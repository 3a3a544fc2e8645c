"""`splitserve serve --on-ray`: run the application on a Ray cluster, or on a local Ray.

Connects to `--ray-address` (or RAY_ADDRESS), else starts a local Ray with
enough logical CPUs for the planned workers; starts Serve's HTTP proxy on
`--host`/the port, deploys the application, waits until the ingress sees
every planned worker ready, prints the URL and then waits. Ctrl-C or SIGTERM
deletes the application (and stops the local Ray it started). Running it again
with another config redeploys in place: only pools whose workers changed are
restarted, a changed replica count just scales.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time

from splitserve.errors import SplitserveError

from splitserve.services.ray_serve.app import build_application
from splitserve.services.ray_serve.config import config_from_args
from splitserve.services.ray_serve.ingress import PoolView
from splitserve.services.ray_serve.settings import RayServeConfig

POLL_S = 0.25


class _Stop(Exception):
    pass


def _raise_stop(signum, frame) -> None:
    raise _Stop(signal.Signals(signum).name)


def expected_workers(config: RayServeConfig) -> dict[str, int]:
    """role -> fixed replica count, for the pools without autoscaling."""
    return {p.worker.role: p.replicas for p in config.pools if p.autoscaling is None}


def wait_for_workers(app_name: str, expected: dict[str, int], timeout: float) -> PoolView:
    """Until the ingress reports exactly `expected` ready workers per role (bounded)."""
    return asyncio.run(_wait_for_workers(app_name, expected, timeout))


async def _wait_for_workers(app_name: str, expected: dict[str, int], timeout: float) -> PoolView:
    from ray import serve

    # A handle made inside this event loop: with RAY_SERVE_THROUGHPUT_OPTIMIZED=1 a handle's
    # router runs on the loop that first uses it, and a driver has no loop of its own.
    handle = serve.get_app_handle(app_name)
    deadline = time.monotonic() + timeout
    while True:
        view: PoolView = await asyncio.wait_for(handle.pool_view.remote(), 30)
        if all(view.num_ready(role) == n and sum(r == role for r in view.known.values()) == n
               for role, n in expected.items()):
            return view
        if time.monotonic() > deadline:
            raise SplitserveError(f"the ingress sees {view.ready} ready of {view.known} after {timeout:.0f} s; "
                                  f"expected {expected}")
        await asyncio.sleep(POLL_S)


def _local_cpus(config: RayServeConfig) -> int:
    """A local Ray gets enough logical CPUs for every planned rank (like `splitserve serve`,
    which starts them all on this machine whatever its core count)."""
    need = sum(max(p.replicas, p.autoscaling.max_replicas if p.autoscaling else 0)
               * p.worker.tensor_parallel * p.cpus_per_rank for p in config.pools)
    return max(os.cpu_count() or 1, int(need + 0.999) + 1)


def deploy(config: RayServeConfig, ready_timeout: float = 600.0):
    """Deploy (or redeploy) the application on the connected Ray; returns the ingress's view
    of its workers once every fixed-size pool is ready in it."""
    from ray import serve

    serve.run(build_application(config), name=config.app_name, route_prefix="/")
    return wait_for_workers(config.app_name, expected_workers(config), ready_timeout)


def run_on_ray(args: argparse.Namespace) -> int:
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise SplitserveError(f"--on-ray needs Ray Serve ({exc}): pip install 'splitserve[ray]'") from None

    config = config_from_args(args)
    if config.ingress.otlp_traces_endpoint:         # the manifest's tracing, or the flag
        from splitserve.tracing import require_tracing

        require_tracing()
    port = args.port if not args.config else config.http_port
    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    started = time.monotonic()
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if address:
            print(f"connecting to Ray at {address}", flush=True)
            ray.init(address=address)
        else:
            print("starting a local Ray", flush=True)
            ray.init(num_cpus=_local_cpus(config), include_dashboard=False)
        serve.start(http_options={"host": args.host, "port": port})
        roles = ", ".join(f"{p.replicas if p.autoscaling is None else 'autoscaled'} {p.worker.role}"
                          for p in config.pools)
        print(f"deploying {config.app_name}: {roles} worker(s), {config.ingress_replicas} ingress", flush=True)
        deploy(config, args.ready_timeout)
        base = f"http://{args.host}:{port}"
        print(f"splitserve is ready: {base}/v1 (OpenAI-compatible, on Ray; "
              f"started in {time.monotonic() - started:.1f} s)", flush=True)
        print(f"  try: curl {base}/v1/models", flush=True)
        while True:
            time.sleep(POLL_S)
    except _Stop as stop:
        print(f"splitserve: {stop}: deleting the application...", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if ray.is_initialized():
            try:
                serve.delete(config.app_name)
                if not address:
                    serve.shutdown()
            finally:
                ray.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
