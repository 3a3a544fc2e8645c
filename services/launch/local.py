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
prints the URL, and then supervises. Ctrl-C, SIGTERM, or any child exiting
stops everything: the children share one process group of their own, which
is signalled as a whole (SIGTERM, then SIGKILL after a grace period), and each
child also gets SIGTERM from the kernel if this process dies (PR_SET_PDEATHSIG),
so no worker outlives it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.errors import SplitserveError
from splitserve.net import free_port
from splitserve.services.cli import security as security_args
from splitserve.tls import PLAINTEXT, TlsConfig

GRACE_S = 10.0
DRAIN_S = GRACE_S - 3.0      # children drain (finish running requests) within the grace period
POLL_S = 0.25


@dataclass(slots=True)
class Child:
    name: str
    process: subprocess.Popen
    address: str = ""          # host:port of a worker's gRPC service
    ready_after: float | None = None


def say(line: str) -> None:
    """One progress line in one write: the children share this stdout, and a line written in
    two parts (print's text, then its newline, when unbuffered) can have theirs in between."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except OSError:
        pass


class Supervisor:
    def __init__(self) -> None:
        self.children: list[Child] = []
        self.pgid: int | None = None

    def spawn(self, name: str, argv: list[str], address: str = "") -> Child:
        process = subprocess.Popen(argv, process_group=self.pgid or 0, preexec_fn=_die_with_parent,
                                   stdin=subprocess.DEVNULL)
        if self.pgid is None:
            self.pgid = process.pid
        child = Child(name, process, address)
        self.children.append(child)
        return child

    def exited(self) -> Child | None:
        return next((c for c in self.children if c.process.poll() is not None), None)

    def stop(self) -> None:
        if self.pgid is None:
            return
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for child in self.children:
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._signal(signal.SIGKILL)     # whatever is left in the group, grandchildren included
        for child in self.children:
            child.process.wait()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass


def _engine_argv(args: argparse.Namespace, model: str) -> list[str]:
    argv = ["--model", model, "--device", args.device, "--dtype", args.dtype, "--tp", str(args.tp),
            "--block-size", str(args.block_size), "--kv-cache-gib", str(args.kv_cache_gib),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-num-seqs", str(args.max_num_seqs)]
    if args.threads is not None:
        argv += ["--threads", str(args.threads)]
    return argv


def _plan(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(name, role) of every worker to start; raises SplitserveError for contradictory flags."""
    if args.aggregated:
        if args.prefill_workers is not None or args.decode_workers is not None:
            raise SplitserveError("--prefill-workers and --decode-workers are for disaggregated serving; "
                                  "with --aggregated use --workers N")
        workers = 1 if args.workers is None else args.workers
        if workers < 1:
            raise SplitserveError("--workers must be at least 1")
        return [(f"worker-{i}", "both") for i in range(workers)]
    if args.workers is not None:
        raise SplitserveError("--workers is for --aggregated serving; disaggregated serving takes "
                              "--prefill-workers N --decode-workers M")
    num_prefill = 1 if args.prefill_workers is None else args.prefill_workers
    num_decode = 1 if args.decode_workers is None else args.decode_workers
    if num_prefill < 1 or num_decode < 1:
        raise SplitserveError("--prefill-workers and --decode-workers must be at least 1 "
                              "(or use --aggregated)")
    return ([(f"prefill-{i}", "prefill") for i in range(num_prefill)]
            + [(f"decode-{i}", "decode") for i in range(num_decode)])


def _worker_argv(args: argparse.Namespace, name: str, role: str, port: int, model: str) -> list[str]:
    argv = ["worker", "--role", role, "--port", str(port), "--worker-id", name, "--drain-timeout", str(DRAIN_S),
            *_engine_argv(args, model)]
    if role != "both":
        argv += ["--transfer", args.transfer, "--remote-prefill-threshold", str(args.remote_prefill_threshold),
                 "--prefill-timeout", str(args.prefill_timeout)]
    return argv + security_args.serve_child_argv(args, "worker")


def _default_served_name(model: str) -> str | None:
    """Clients ask for the model by the name the operator typed: `--model smollm2` serves "smollm2"."""
    if not model.strip().lower().startswith("smollm2"):
        return None          # a folder or file: the workers report its name
    from splitserve.services.engine.loading.model_source import SMOLLM2_NAMES

    return model.strip() if model.strip().lower() in SMOLLM2_NAMES else None


def _frontend_argv(args: argparse.Namespace, model: str, host: str, port: int, grpc_port: int,
                   workers: list[Child], plan: list[tuple[str, str]]) -> list[str]:
    """One frontend (router replica): every replica gets every worker and builds its own index."""
    argv = ["--model", model, "--host", host, "--port", str(port), "--grpc-port", str(grpc_port),
            "--router", args.router, "--prefill-weight", str(args.prefill_weight),
            "--router-temperature", str(args.router_temperature),
            "--remote-prefill-threshold", str(args.remote_prefill_threshold),
            "--migration-limit", str(args.migration_limit), "--drain-timeout", str(DRAIN_S)]
    for w, (_, role) in zip(workers, plan):
        argv += ["--worker", f"{role}={w.address}"]
    served_name = args.served_model_name or _default_served_name(args.model)
    if served_name:
        argv += ["--served-model-name", served_name]
    return argv + security_args.serve_child_argv(args, "frontend")


def _resolve_model(name: str) -> str:
    if not name.strip().lower().startswith("smollm2"):
        return name          # a folder or a file: the workers open it (no torch import here)
    from splitserve.services.engine.loading.model_source import SMOLLM2_NAMES, resolve_smollm2

    if name.strip().lower() in SMOLLM2_NAMES:
        say("preparing the shipped SmolLM2-135M-Instruct (converted once into the cache)...")
        return str(resolve_smollm2())
    return name


def worker_serving(address: str, tls: TlsConfig = PLAINTEXT) -> bool:
    """The worker's gRPC health says SERVING (also the Ray worker replica's readiness check)."""
    with tls.channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=1.0)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _http_ready(url: str) -> bool:
    """The frontend answers /ready with 200 and sees every worker ready."""
    # A readiness probe of our own child: with HTTPS its certificate is not checked here.
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=1.0, context=context) as reply:
            return reply.status == 200 and json.loads(reply.read()).get("all_workers_ready", True)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _wait_ready(sup: Supervisor, workers: list[Child], ready_url: str, timeout: float,
                tls: TlsConfig = PLAINTEXT) -> None:
    start = time.monotonic()
    pending = list(workers)
    while pending:
        _check_alive(sup)
        for child in list(pending):
            if worker_serving(child.address, tls):
                pending.remove(child)
                say(f"  {child.name} ready ({time.monotonic() - start:.1f} s) at {child.address}")
        if time.monotonic() - start > timeout:
            raise SplitserveError(f"workers not ready after {timeout:.0f} s: "
                                  f"{', '.join(c.name for c in pending)}")
        time.sleep(POLL_S)
    while not _http_ready(ready_url):
        _check_alive(sup)
        if time.monotonic() - start > timeout:
            raise SplitserveError(f"the frontend is not ready after {timeout:.0f} s")
        time.sleep(POLL_S)


def _check_alive(sup: Supervisor) -> None:
    gone = sup.exited()
    if gone is not None:
        raise SplitserveError(f"{gone.name} exited with code {gone.process.returncode} (see its log above)")


class _Stop(Exception):
    pass


def _raise_stop(signum, frame) -> None:
    raise _Stop(signal.Signals(signum).name)


def _transfer_backend(address: str, tls: TlsConfig = PLAINTEXT) -> str:
    from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc

    with tls.channel(address) as channel:
        try:
            info = worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=5)
        except grpc.RpcError:
            return "unknown"
    return info.transfer_backend or "none"


def run_serve(args: argparse.Namespace) -> int:
    plan = _plan(args)
    security_args.check_serve_args(args)
    security_args.export_serve_secrets(args, os.environ)      # children read them from the environment
    tls = TlsConfig(cert=args.tls_internal_cert, key=args.tls_internal_key, ca=args.tls_ca)
    scheme = "https" if args.tls_cert else "http"
    model = _resolve_model(args.model)
    host = args.host
    port = args.port or free_port(host)
    grpc_port = args.grpc_port if args.grpc_port is not None else port + 1
    grpc_port = grpc_port or free_port(host)
    python = [sys.executable, "-m", "splitserve", "--log-level", args.log_level]
    sup = Supervisor()
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        workers = []
        roles = [role for _, role in plan]
        if args.aggregated:
            say(f"starting {len(plan)} aggregated worker(s) and the frontend for {model}")
        else:
            say(f"starting {roles.count('prefill')} prefill and {roles.count('decode')} decode worker(s) "
                f"(KV transfer: {args.transfer}) and the frontend for {model}")
        for name, role in plan:
            wport = free_port("127.0.0.1")
            workers.append(sup.spawn(name, [*python, *_worker_argv(args, name, role, wport, model)],
                                     f"127.0.0.1:{wport}"))
        ports = [port] + [free_port(host) for _ in range(max(args.frontends, 1) - 1)]
        for i, fport in enumerate(ports):
            gport = grpc_port if i == 0 else free_port(host)
            sup.spawn("frontend" if i == 0 else f"frontend-{i}",
                      [*python, "frontend", *_frontend_argv(args, model, host, fport, gport, workers, plan)])
        base = f"{scheme}://{host}:{port}"
        _wait_ready(sup, workers, f"{base}/ready", args.ready_timeout, tls)
        for fport in ports[1:]:
            _wait_ready(sup, [], f"{scheme}://{host}:{fport}/ready", args.ready_timeout)
            say(f"  frontend replica: {scheme}://{host}:{fport}/v1")
        if not args.aggregated:
            say(f"  KV transfer between prefill and decode workers: "
                f"{_transfer_backend(workers[0].address, tls)}")
        say(f"splitserve is ready: {base}/v1 (OpenAI-compatible), gRPC {host}:{grpc_port}")
        say(f"  try: curl {base}/v1/models")
        while True:
            _check_alive(sup)
            time.sleep(POLL_S)
    except _Stop as stop:
        say(f"splitserve: {stop}: stopping...")
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sup.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
