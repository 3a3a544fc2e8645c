"""Tensor parallelism: one process per rank over torch.distributed.

Rank 0 is the engine that the rest of the system talks to: it schedules, samples
and owns the block bookkeeping. Each other rank loads its Megatron shard and a KV
tensor with its share of the KV heads and the same block count, then runs whatever
`ForwardBatch` rank 0 broadcasts. The two all-reduces per layer happen inside the
model. gloo on CPU, NCCL on CUDA.

The ranks come from one of two places. By default (`--tp N`) ranks 1..N-1 are
started here as child processes. With `config.tp_leader` set, they are processes
started independently (one pod each, `splitserve worker` with SPLITSERVE_TP_RANK
>= 1, `run_member`) that dial rank 0's rendezvous (rendezvous.py). Either way
rank 0 has one control connection per rank (rank_control.py) for work that is
not per step, such as the KV connector that each rank registers on its own KV
pool; a batch's `layer_reports` tell a rank's layer hook which prefill-only
sequences to push after each layer.

A group that lost a rank cannot step again (the collectives need every rank), so
losing one (its control connection closes, or a step fails) is final: `watch`
callbacks hear it once, and the worker exits so that the group is replaced as a
unit. Rank 0 waits until every rank has loaded its shard (`wait_ready`) before the
worker reports SERVING.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from splitserve.errors import FatalError
from splitserve.net import free_port

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.core_sharing import CoreSharing
from splitserve.services.engine.cpu_placement import apply_rank_threads
from splitserve.services.engine.model.forward_batch import ForwardBatch
from splitserve.services.engine.rank import build_rank
from splitserve.services.engine.parallel import rendezvous
from splitserve.services.engine.parallel.rank_control import (RankContext, RankControl, RankControlError,
                                                              serve_control)

log = logging.getLogger(__name__)

# The other ranks wait in a broadcast for rank 0's next step, and an idle worker may see
# no step for hours: with torch's default (30 min for gloo, 10 for NCCL) an idle group's
# ranks died of a timeout. A rank that dies is noticed at once anyway (its sockets close).
GROUP_TIMEOUT = timedelta(days=365)
# How long a failed step waits for a dead rank's control connection to close (it closes with
# the process, within milliseconds).
STEP_FAILURE_GRACE_S = 2.0


class GroupLostError(FatalError):
    """A tensor-parallel rank is gone (or a step failed): the group cannot step again."""


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _rank_device(device: str, rank: int) -> str:
    return f"cuda:{rank}" if device == "cuda" else device


def _join_group(device: str, init_method: str, rank: int, world_size: int, timeout_s: float) -> None:
    """Rendezvous within `timeout_s`; collectives then wait up to GROUP_TIMEOUT."""
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
    _init_group(device, store, rank, world_size)


def _init_group(device: str, store: dist.Store, rank: int, world_size: int) -> None:
    dist.init_process_group(_backend(device), store=store, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT)


def _rank_ready(ctx: RankContext) -> int:
    """Control call: answered once the rank has loaded its shard (its control thread starts then)."""
    return ctx.rank


class TensorParallelGroup:
    """Ranks 1..N-1 (started here, or dialling in), and rank 0's membership of the group."""

    def __init__(self, config: EngineConfig):
        self.world_size = config.tensor_parallel_size
        self.procs: list[mp.Process] = []
        self._closed = True
        self._closing = False
        self._lost: str | None = None
        self._watchers: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        if config.device.startswith("cuda"):
            torch.cuda.set_device(_rank_device(config.device, 0))
        try:
            if config.tp_leader:
                self._host_members(config)
            else:
                self._start_children(config)
        except Exception as exc:
            self.close()
            raise FatalError(f"tensor-parallel group failed to start: {exc}") from exc
        self._closed = False

    def _start_children(self, config: EngineConfig) -> None:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.config = replace(config, dist_init_method=init_method)
        ctx = mp.get_context("spawn")
        pipes = {rank: ctx.Pipe(duplex=True) for rank in range(1, self.world_size)}
        self.procs = [ctx.Process(target=_worker_main, args=(self.config, rank, pipes[rank][1]), daemon=True,
                                  name=f"splitserve-tp-rank{rank}")
                      for rank in range(1, self.world_size)]
        for p in self.procs:
            p.start()
        for _, child_end in pipes.values():
            child_end.close()
        self.control = RankControl({rank: parent_end for rank, (parent_end, _) in pipes.items()},
                                   on_lost=self._rank_lost)
        _join_group(config.device, init_method, 0, self.world_size, config.tp_join_timeout_s)

    def _host_members(self, config: EngineConfig) -> None:
        self.config = config
        port = int(config.tp_leader.rsplit(":", 1)[1])
        store, conns = rendezvous.host_group(config, port, config.tp_join_timeout_s)
        self.control = RankControl(conns, on_lost=self._rank_lost)
        _init_group(config.device, store, 0, self.world_size)

    def wait_ready(self) -> None:
        """Until every rank has loaded its shard (bounded by the join timeout)."""
        try:
            self.control.call_all(_rank_ready, timeout_s=self.config.tp_join_timeout_s)
        except RankControlError as exc:
            self.fail(str(exc))
            raise GroupLostError(f"tensor-parallel group not ready: {exc}") from exc

    def watch(self, callback: Callable[[str], None]) -> None:
        """`callback(why)` once, when the group is lost (at once if it already is)."""
        with self._lock:
            lost = self._lost
            if lost is None:
                self._watchers.append(callback)
        if lost is not None:
            callback(lost)

    def fail(self, why: str) -> None:
        """The group is lost (a step failed, a rank is gone): tell the watchers, once."""
        with self._lock:
            if self._lost is not None or self._closing:
                return
            self._lost = why
            watchers, self._watchers = self._watchers, []
        log.error("tensor-parallel group lost: %s", why)
        for callback in watchers:
            try:
                callback(why)
            except Exception:
                log.exception("tensor-parallel group: a watcher failed")

    def step_failed(self, exc: BaseException) -> None:
        """A step failed. When a rank died, its collectives and its control connection fail
        together, in either order: wait a moment for the control connection, so that the
        group's failure names the rank that is gone rather than a peer's socket error."""
        if self.control.wait_lost(STEP_FAILURE_GRACE_S):
            return          # _rank_lost failed the group, naming the rank
        self.fail(f"a step failed: {exc}")

    @property
    def lost(self) -> str | None:
        return self._lost

    def _rank_lost(self, rank: int, why: str) -> None:
        self.fail(f"tensor-parallel rank {rank} is gone ({why})")

    def broadcast(self, batch: ForwardBatch | None) -> None:
        payload = [batch.to(torch.device("cpu")) if batch is not None else None]
        dist.broadcast_object_list(payload, src=0)

    def close(self) -> None:
        with self._lock:
            self._closing = True        # the ranks leaving now is no loss
        if self._closed is False:
            try:
                if self._lost is None:      # a lost group's collectives fail, or hang
                    self.broadcast(None)
            finally:
                dist.destroy_process_group()
            self._closed = True
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if hasattr(self, "control"):
            self.control.close()


def serve_rank(config: EngineConfig, rank: int, conn, device: str, host: str | None = None,
               advertise_host: str | None = None, core_sharing: CoreSharing | None = None) -> None:
    """A rank's life once it joined the group: load its shard, serve the control connection,
    run rank 0's steps until rank 0 broadcasts None. `host`: where this rank's KV connector
    listens (None: where rank 0's does, the same machine)."""
    ctx = None
    try:
        model, kv = build_rank(replace(config, device=device), rank)
        ctx = RankContext(rank, config.tensor_parallel_size, config, kv, emit=lambda _: None, host=host,
                          advertise_host=advertise_host)
        serve_control(conn, ctx)
        while True:
            payload = [None]
            dist.broadcast_object_list(payload, src=0)
            batch = payload[0]
            if batch is None:
                break
            hook = ctx.layer_hook
            layer_done = hook(batch.layer_reports) if hook is not None and batch.layer_reports else None
            if core_sharing is not None:
                core_sharing.before_step()
            model.forward(batch.to(torch.device(device)), kv, layer_done)
    except Exception:
        log.exception("tensor-parallel rank %d failed (pid %d)", rank, os.getpid())
        raise
    finally:
        for close in ctx.closers if ctx is not None else []:
            try:
                close()
            except Exception:
                log.exception("tensor-parallel rank %d: closing %r failed", rank, close)
        conn.close()
        dist.destroy_process_group()


def _worker_main(config: EngineConfig, rank: int, conn) -> None:
    # Rank 0 stops this rank (a None broadcast) once it has drained; a signal to the whole
    # process group (Ctrl-C, `splitserve serve` stopping) must not kill it first. Should
    # rank 0 die instead, the next collective fails and this rank exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sharing = apply_rank_threads(config, rank)
    device = _rank_device(config.device, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)   # NCCL's object broadcast uses the current device
    _join_group(config.device, config.dist_init_method, rank, config.tensor_parallel_size,
                config.tp_join_timeout_s)
    serve_rank(config, rank, conn, device, core_sharing=sharing)


def run_member(member: rendezvous.GroupMember, own: EngineConfig, host: str, advertise_host: str | None = None) -> int:
    """`splitserve worker` as rank `member.rank` >= 1 of a group started pod by pod: join
    rank 0 through the leader address, then serve its steps and control calls until it
    stops the group (exit 0); a failure, rank 0's included, exits non-zero.

    SIGTERM is ignored once joined, as on the local ranks: rank 0 stops the group after
    its drain (its pod is stopped at the same time), and a rank leaving first would fail
    the requests it is draining. Before that, SIGTERM stops the wait for the leader."""
    sharing = apply_rank_threads(replace(own, tensor_parallel_size=1), 0)    # a pod's cores are its own
    device = "cuda:0" if own.device == "cuda" else own.device     # one device per pod
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    print(f"tensor-parallel rank {member.rank}/{member.world_size}: joining {member.leader}", flush=True)
    store, conn, leader_config = rendezvous.join_leader(member)
    config = rendezvous.member_config(own, leader_config)
    _init_group(device, store, member.rank, member.world_size)
    signal.signal(signal.SIGTERM, lambda *_: log.info("rank %d: SIGTERM: serving until rank 0 stops the group",
                                                      member.rank))
    print(f"tensor-parallel rank {member.rank}/{member.world_size}: joined {member.leader}, loading "
          f"{config.num_kv_blocks} KV blocks", flush=True)
    serve_rank(config, member.rank, conn, device, host, advertise_host, sharing)
    log.info("tensor-parallel rank %d: stopped by rank 0", member.rank)
    return 0
