"""`splitserve serve`: workers and the frontend as processes on this machine.

Disaggregated by default: N prefill workers and M decode workers (1 + 1), the
KV transfer between them over NIXL when it is importable, else TCP;
`--aggregated` runs `--workers N` workers that prefill and decode themselves.

Static discovery: this process picks the ports, starts every worker and the
frontend (passing them the workers' addresses; `--router` picks the policy,
default kv; `--frontends K` starts K frontends — router replicas — each on
its own HTTP port, `--port` for the first and free ports for the others, all
printed, each building the same KV index from the workers' events), shows progress until each
worker reports SERVING through gRPC health and the frontend's /ready answers,
prints the URL, and then supervises (supervisor.py): a worker or frontend that
exits, or a worker that stops answering its health checks, is restarted with
back-off while the others keep serving (a lost worker's requests migrate). A
child that exits before the deployment is ready stops everything (a bad flag
or model would only crash again). Ctrl-C or SIGTERM stops everything: the
children share one process group, signalled as a whole (SIGTERM, then SIGKILL
after a grace period), and each child also gets SIGTERM from the kernel if this
process dies (PR_SET_PDEATHSIG), so no worker outlives it.

`--autoscale` (autoscale_thread.py): the workers and frontends find each other through a local
etcd that serve starts first (membership.py) instead of a static list; once every worker
is ready a short profile run times the first worker's prefill and decode
(profile_run.py), and then the autoscaler's thread starts and drains workers, between
1 and --max-workers, as the SLO planner decides.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import grpc

from splitserve.errors import SplitserveError
from splitserve.net import claim_port, free_port
from splitserve.services.engine_vllm.environment import (check_engine_python, default_engine_python,
                                                        resolve_vllm_model)
from splitserve.services.launch.children import export_serve_secrets, frontend_argv, kvstore_argv, worker_argv
from splitserve.services.launch.membership import ETCD_ENV, LocalEtcd
from splitserve.services.launch.topology import (autoscale_settings, default_threads, plan_workers, process_role,
                                             resolve_model, worker_cores, worker_slots)
from splitserve.services.launch.probes import http_ready, transfer_backend, worker_serving
from splitserve.services.launch.supervisor import Child, Supervisor
from splitserve.tls import PLAINTEXT, TlsConfig

POLL_S = 0.1


def say(line: str) -> None:
    """One progress line in one write: the children share this stdout, and a line written in
    two parts (print's text, then its newline, when unbuffered) can have theirs in between."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _wait_ready(sup: Supervisor, workers: list[Child], ready_url: str, timeout: float,
                tls: TlsConfig = PLAINTEXT) -> dict[str, float]:
    """Wait for every worker's SERVING, then the frontend's /ready; each worker's time from its
    start to SERVING, by name."""
    start = time.monotonic()
    pending = list(workers)
    took: dict[str, float] = {}
    while pending:
        _check_alive(sup)
        for child in list(pending):
            if worker_serving(child.address, tls):
                pending.remove(child)
                took[child.name] = time.monotonic() - child.started
                say(f"  {child.name} ready ({time.monotonic() - start:.1f} s) at {child.address}")
        if time.monotonic() - start > timeout:
            raise SplitserveError(f"workers not ready after {timeout:.0f} s: "
                                  f"{', '.join(c.name for c in pending)}")
        time.sleep(POLL_S)
    while not http_ready(ready_url):
        _check_alive(sup)
        if time.monotonic() - start > timeout:
            raise SplitserveError(f"the frontend is not ready after {timeout:.0f} s")
        time.sleep(POLL_S)
    return took


def _start_kvstore(sup: Supervisor, args: argparse.Namespace, python: list[str]) -> str | None:
    """With --kv-store-gib: the shared block store, listening before any worker starts; its address.
    The supervisor restarts it on the same port if it exits (it comes back empty; workers attach again)."""
    if not args.kv_store_gib:
        return None
    port = free_port("127.0.0.1")
    address = f"127.0.0.1:{port}"
    sup.spawn("kvstore", [*python, *kvstore_argv(args, port)])
    start = time.monotonic()
    while not worker_serving(address):          # the store serves the standard gRPC health too
        _check_alive(sup)
        if time.monotonic() - start > args.ready_timeout:
            raise SplitserveError(f"the KV store is not listening after {args.ready_timeout:.0f} s")
        time.sleep(POLL_S)
    say(f"  kvstore ready at {address} ({args.kv_store_gib:g} GiB shared by every worker)")
    return address


def _check_alive(sup: Supervisor) -> None:
    gone = sup.exited()
    if gone is not None:
        raise SplitserveError(f"{gone.name} exited with code {gone.process.returncode} (see its log above)")


class _Stop(Exception):
    pass


def _raise_stop(signum, frame) -> None:
    raise _Stop(signal.Signals(signum).name)


def _start_etcd(sup: Supervisor, args: argparse.Namespace, etcd: LocalEtcd) -> None:
    """--autoscale: the local etcd the workers register in and the frontends follow (membership.py),
    in a process group of its own: it stops after the workers, which deregister when they drain."""
    sup.spawn("etcd", etcd.argv(), own_group=True, env=ETCD_ENV)
    etcd.wait_healthy(args.ready_timeout, lambda: _check_alive(sup))
    say(f"  etcd ready at {etcd.endpoint} (worker membership for --autoscale)")


def _start_autoscaler(sup: Supervisor, args: argparse.Namespace, settings, worker_python: list[str], model: str,
                      slot_cores: list[str | None], kv_store: str | None, etcd: LocalEtcd, workers: list[Child],
                      plan, startup: dict[str, float], frontend_urls: list[str], tls: TlsConfig):
    from splitserve.services.launch.autoscale_thread import local_autoscaler
    from splitserve.services.launch.local_scaling import ScaledWorker, launcher_for
    from splitserve.services.launch.profile_run import profile_worker

    first = next(c for c, w in zip(workers, plan) if w.role != "prefill")
    try:
        result = profile_worker(first.address, startup.get(first.name, 0.0), args.max_num_seqs, tls)
    except grpc.RpcError as exc:
        raise SplitserveError(f"the autoscaler's profile run on {first.name} failed: {exc.code().name}: "
                              f"{exc.details()}") from None
    say(f"  autoscale: {first.name}'s profile: {result.describe()}")
    scaled = [ScaledWorker(c.name, int(c.name.rsplit("-", 1)[1]), w.role, i, c, changed_at=time.monotonic(),
                           process_role=process_role(w.role, settings))
              for i, (c, w) in enumerate(zip(workers, plan))]
    metrics = None
    if args.autoscale_metrics_port is not None:
        from prometheus_client import start_http_server

        from splitserve.services.planner.decision_metrics import DecisionMetrics

        server, _ = start_http_server(args.autoscale_metrics_port, "127.0.0.1")
        metrics = DecisionMetrics()
        say(f"  autoscale: decisions as metrics on http://127.0.0.1:{server.server_port}/metrics")
    autoscaler = local_autoscaler(sup, say, settings, args.aggregated, result.profile,
                                  launcher_for(sup, args, worker_python, model, slot_cores, kv_store, etcd.endpoint),
                                  scaled, frontend_urls, tls, metrics)
    say(f"  autoscale: 1 to {settings.max_workers} workers for TTFT p90 {settings.ttft_p90_s * 1e3:g} ms and "
        f"ITL p90 {settings.itl_p90_s * 1e3:g} ms, every {settings.interval_s:g} s, cool-down "
        f"{settings.cooldown_s:g} s; mode {autoscaler.loop.planner.config.mode.value}")
    return autoscaler


def vllm_python(args: argparse.Namespace) -> str:
    """The vLLM workers' python: --engine-python, else the engine environment's (a clear error
    naming the install command when it is missing)."""
    return check_engine_python(args.engine_python or default_engine_python())


def run_serve(args: argparse.Namespace) -> int:
    plan = plan_workers(args)
    autoscale = autoscale_settings(args, plan)
    if autoscale is None and args.autoscale_metrics_port is not None:
        raise SplitserveError("--autoscale-metrics-port needs --autoscale")
    slots = worker_slots(plan, autoscale.max_workers) if autoscale else plan
    slot_cores = worker_cores(args, slots)
    cores = slot_cores[:len(plan)]
    if not any(slot_cores):
        args.threads = default_threads(args, slots)    # pinned workers run one thread per core
    export_serve_secrets(args, os.environ)      # children read them from the environment
    tls = TlsConfig(cert=args.tls_internal_cert, key=args.tls_internal_key, ca=args.tls_ca)
    scheme = "https" if args.tls_cert else "http"
    model = resolve_model(args.model, say) if args.engine != "vllm" else resolve_vllm_model(args.model)
    host = args.host
    for given in (args.port, args.grpc_port):
        if given:
            claim_port(given)       # not bound until the frontend starts: free_port must not hand it out
    port = args.port or free_port(host)
    grpc_port = args.grpc_port if args.grpc_port is not None else port + 1
    if args.grpc_port is None:
        claim_port(grpc_port)
    grpc_port = grpc_port or free_port(host)
    python = [sys.executable, "-m", "splitserve", "--log-level", args.log_level]
    # vLLM workers run with the vLLM engine environment's python (docs/engines.md); the rest with ours.
    worker_python = python if args.engine != "vllm" else [vllm_python(args), *python[1:]]
    sup = Supervisor(say, tls, args.ready_timeout)
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    etcd = autoscaler = None
    try:
        workers = []
        roles = [w.role for w in plan]
        if args.aggregated:
            engine = " vLLM" if args.engine == "vllm" else ""
            say(f"starting {len(plan)} aggregated{engine} worker(s) and the frontend for {model}")
        else:
            say(f"starting {roles.count('prefill')} prefill and {roles.count('decode')} decode worker(s) "
                f"(KV transfer: {args.transfer}) and the frontend for {model}")
        kv_store = _start_kvstore(sup, args, python)
        if autoscale:
            etcd = LocalEtcd.plan()
            _start_etcd(sup, args, etcd)
        endpoint = etcd.endpoint if etcd else None
        metrics_urls: dict[str, str] = {}
        for w, wcores in zip(plan, cores):
            wport = free_port("127.0.0.1")
            role = process_role(w.role, autoscale)
            # A fixed port per worker, so a restarted worker serves its metrics where it did.
            mport = free_port("127.0.0.1") if getattr(args, "worker_metrics", False) else None
            if mport is not None:
                metrics_urls[w.name] = f"http://127.0.0.1:{mport}/metrics"
            workers.append(sup.spawn(w.name, [*worker_python, *worker_argv(args, w.name, role, wport, model, wcores,
                                                                    kv_store, endpoint, mport)],
                                     f"127.0.0.1:{wport}"))
        ports = [port] + [free_port(host) for _ in range(max(args.frontends, 1) - 1)]
        for i, fport in enumerate(ports):
            gport = grpc_port if i == 0 else free_port(host)
            sup.spawn("frontend" if i == 0 else f"frontend-{i}",
                      [*python, "frontend", *frontend_argv(args, model, host, fport, gport,
                                                          [c.address for c in workers], plan, endpoint)])
        base = f"{scheme}://{host}:{port}"
        startup = _wait_ready(sup, workers, f"{base}/ready", args.ready_timeout, tls)
        for fport in ports[1:]:
            _wait_ready(sup, [], f"{scheme}://{host}:{fport}/ready", args.ready_timeout)
            say(f"  frontend replica: {scheme}://{host}:{fport}/v1")
        for name, url in metrics_urls.items():
            say(f"  {name} metrics on {url}")
        if not args.aggregated:
            say(f"  KV transfer between prefill and decode workers: "
                f"{transfer_backend(workers[0].address, tls)}")
        if autoscale:
            autoscaler = _start_autoscaler(sup, args, autoscale, worker_python, model, slot_cores, kv_store, etcd, workers,
                                           plan, startup, [f"{scheme}://{host}:{p}" for p in ports], tls)
        say(f"splitserve is ready: {base}/v1 (OpenAI-compatible), gRPC {host}:{grpc_port}")
        say(f"  try: curl {base}/v1/models")
        if autoscaler is not None:
            autoscaler.start()
        while True:
            sup.supervise()      # restarts what exits or stops answering (supervisor.py)
            time.sleep(POLL_S)
    except _Stop as stop:
        say(f"splitserve: {stop}: stopping...")
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if autoscaler is not None:
            autoscaler.stop()
        sup.stop()
        if etcd is not None:
            etcd.remove_data()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
