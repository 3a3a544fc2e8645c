"""Tensor parallelism: one process per rank over torch.distributed.

Rank 0 is the engine that the rest of the system talks to: it schedules, samples
and owns the block bookkeeping. Ranks 1..N-1 are started here as child
processes; each loads its Megatron shard and a KV tensor with its share of the
KV heads and the same block count, then runs whatever `ForwardBatch` rank 0
broadcasts. The two all-reduces per layer happen inside the model. gloo on CPU,
NCCL on CUDA.

Besides the per-step broadcast, each child has a control pipe to rank 0
(rank_control.py) for work that is not per step, such as the KV connector
that each rank registers on its own KV pool; a batch's `layer_reports` tell a
rank's layer hook which prefill-only sequences to push after each layer.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from splitserve.errors import FatalError
from splitserve.net import free_port

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.model.forward_batch import ForwardBatch
from splitserve.services.engine.rank import build_rank
from splitserve.services.engine.parallel.rank_control import RankContext, RankControl, serve_control

log = logging.getLogger(__name__)

# The other ranks wait in a broadcast for rank 0's next step, and an idle worker may see
# no step for hours: with torch's default (30 min for gloo, 10 for NCCL) an idle group's
# ranks died of a timeout. A rank that dies is noticed at once anyway (its sockets close).
GROUP_TIMEOUT = timedelta(days=365)
RENDEZVOUS_TIMEOUT = timedelta(minutes=30)     # every rank must have joined by then (torch's default)


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _rank_device(device: str, rank: int) -> str:
    return f"cuda:{rank}" if device == "cuda" else device


def _join_group(device: str, init_method: str, rank: int, world_size: int) -> None:
    """Rendezvous within RENDEZVOUS_TIMEOUT; collectives then wait up to GROUP_TIMEOUT."""
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=RENDEZVOUS_TIMEOUT)
    dist.init_process_group(_backend(device), store=store, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT)


class TensorParallelGroup:
    """Starts ranks 1..N-1 and joins the process group as rank 0."""

    def __init__(self, config: EngineConfig):
        self.world_size = config.tensor_parallel_size
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
        self.control = RankControl({rank: parent_end for rank, (parent_end, _) in pipes.items()})
        if config.device.startswith("cuda"):
            torch.cuda.set_device(_rank_device(config.device, 0))
        try:
            _join_group(config.device, init_method, 0, self.world_size)
        except Exception as exc:
            self.close()
            raise FatalError(f"tensor-parallel group failed to start: {exc}") from exc
        self._closed = False

    def broadcast(self, batch: ForwardBatch | None) -> None:
        payload = [batch.to(torch.device("cpu")) if batch is not None else None]
        dist.broadcast_object_list(payload, src=0)

    def close(self) -> None:
        if getattr(self, "_closed", True) is False:
            try:
                self.broadcast(None)
            finally:
                dist.destroy_process_group()
            self._closed = True
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self.control.close()


def _worker_main(config: EngineConfig, rank: int, conn) -> None:
    # Rank 0 stops this rank (a None broadcast) once it has drained; a signal to the whole
    # process group (Ctrl-C, `splitserve serve` stopping) must not kill it first. Should
    # rank 0 die instead, the next collective fails and this rank exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = _rank_device(config.device, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)   # NCCL's object broadcast uses the current device
    _join_group(config.device, config.dist_init_method, rank, config.tensor_parallel_size)
    ctx = None
    try:
        model, kv = build_rank(replace(config, device=device), rank)
        ctx = RankContext(rank, config.tensor_parallel_size, config, kv, emit=lambda _: None)
        serve_control(conn, ctx)
        while True:
            payload = [None]
            dist.broadcast_object_list(payload, src=0)
            batch = payload[0]
            if batch is None:
                break
            hook = ctx.layer_hook
            layer_done = hook(batch.layer_reports) if hook is not None and batch.layer_reports else None
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
