"""Tensor parallelism: one process per rank over torch.distributed.

Rank 0 is the engine that the rest of the system talks to: it schedules, samples
and owns the block bookkeeping. Ranks 1..N-1 are started here as child
processes; each loads its Megatron shard and a KV tensor with its share of the
KV heads and the same block count, then runs whatever `ForwardBatch` rank 0
broadcasts. The two all-reduces per layer happen inside the model. gloo on CPU,
NCCL on CUDA.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from dataclasses import replace

import torch
import torch.distributed as dist

from splitserve.errors import FatalError
from splitserve.net import free_port

from .config import EngineConfig
from .forward_batch import ForwardBatch

log = logging.getLogger(__name__)


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _rank_device(device: str, rank: int) -> str:
    return f"cuda:{rank}" if device == "cuda" else device


def all_reduce(t: torch.Tensor) -> None:
    dist.all_reduce(t)


class TensorParallelGroup:
    """Starts ranks 1..N-1 and joins the process group as rank 0."""

    def __init__(self, config: EngineConfig):
        self.world_size = config.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.config = replace(config, dist_init_method=init_method)
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_worker_main, args=(self.config, rank), daemon=True,
                                  name=f"splitserve-tp-rank{rank}")
                      for rank in range(1, self.world_size)]
        for p in self.procs:
            p.start()
        if config.device.startswith("cuda"):
            torch.cuda.set_device(_rank_device(config.device, 0))
        try:
            dist.init_process_group(_backend(config.device), init_method=init_method,
                                    rank=0, world_size=self.world_size)
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


def _worker_main(config: EngineConfig, rank: int) -> None:
    from .engine import build_rank   # late import: runs in a fresh spawned process

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = _rank_device(config.device, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)   # NCCL's object broadcast uses the current device
    dist.init_process_group(_backend(config.device), init_method=config.dist_init_method,
                            rank=rank, world_size=config.tensor_parallel_size)
    try:
        model, kv = build_rank(replace(config, device=device), rank)
        while True:
            payload = [None]
            dist.broadcast_object_list(payload, src=0)
            batch = payload[0]
            if batch is None:
                break
            model.forward(batch.to(torch.device(device)), kv)
    except Exception:
        log.exception("tensor-parallel rank %d failed (pid %d)", rank, os.getpid())
        raise
    finally:
        dist.destroy_process_group()
