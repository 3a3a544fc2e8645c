"""A worker's gRPC API as tests use it: Stats, the leak check, one token-level Generate.

`idle_problems()` is the leak check every test that drives workers ends with: a worker
is idle when its Stats say no KV block is used (fenced ones included) and none is
fenced, no request runs or waits, no transfer reservation is open, no finished prefill
still holds blocks, and no call or remote prefill is in flight. `wait_idle()` polls
that (bounded) on several workers, because some of it is released in the background
(a given-up reservation's blocks once its fence is answered, an aborted request's by
the next engine step).

`wait_running()` waits until a worker runs a request, so that a test can kill or cancel
something mid-request. `generate()` sends one TokenGenerateRequest straight to a worker,
naming the prefill workers it may use, so that a test chooses exactly where a prompt is
prefilled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import grpc

from splitserve.proto.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from splitserve.testing.waiting import async_wait_until, wait_until

IDLE_POLL_S = 0.02


def worker_stats(address: str, timeout: float = 5.0) -> worker_pb2.StatsResponse:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=timeout)


def idle_problems(s: worker_pb2.StatsResponse) -> list[str]:
    """What a worker still holds (empty when idle)."""
    held = {"used KV blocks": s.num_used_kv_blocks, "transfer reservations": s.num_transfer_reservations,
            "held prefills": s.num_held_prefills, "remote prefills waiting": s.num_remote_prefill,
            "running": s.num_running, "waiting": s.num_waiting, "calls in flight": s.num_in_flight,
            "fenced KV blocks": s.num_fenced_kv_blocks, "suspended requests": s.num_suspended_held}
    return [f"{v} {k}" for k, v in held.items() if v]


@dataclass(slots=True)
class Idle:
    """What wait_idle saw: each worker's last Stats, and how long it took to get there."""

    stats: dict[str, worker_pb2.StatsResponse]
    took_s: float


def wait_idle(workers: Mapping[str, str] | Iterable, limit_s: float, since: float | None = None,
              stats_timeout_s: float = 5.0) -> Idle:
    """Poll until every worker is idle; AssertionError naming what each still holds when
    `limit_s` has passed since `since` (time.monotonic(); default: now).

    `workers` maps names to addresses, or is a list of objects with `name` and `address`
    (splitserve.testing.cluster.Worker). `stats_timeout_s`: each Stats call's (a worker answers
    Stats between engine steps, and a long prefill step delays it)."""
    addresses = dict(workers) if isinstance(workers, Mapping) else {w.name: w.address for w in workers}
    start = time.monotonic() if since is None else since
    problems: dict[str, list[str]] = {}

    def idle() -> Idle | None:
        stats = {name: worker_stats(address, stats_timeout_s) for name, address in addresses.items()}
        problems.clear()
        problems.update({name: p for name, s in stats.items() if (p := idle_problems(s))})
        return None if problems else Idle(stats, time.monotonic() - start)

    return wait_until(idle, timeout=limit_s - (time.monotonic() - start), interval=IDLE_POLL_S,
                      what=f"every worker to be idle within {limit_s:.1f} s",
                      details=lambda: f"still held: {problems}")


async def wait_running(address: str, request: asyncio.Task | None = None, timeout: float = 30.0,
                       interval: float = 0.01) -> None:
    """Until the worker at `address` runs a request (a prefill worker: computes a prompt now),
    to break something mid-request; fails at once when `request`, the task that sent it, ends first."""
    def running() -> bool:
        assert request is None or not request.done(), f"the request ended before the worker at {address} ran it"
        return worker_stats(address).num_running > 0

    await async_wait_until(running, timeout=timeout, interval=interval,
                           what=f"the worker at {address} to run a request")


@dataclass(slots=True)
class Generated:
    """One Generate call's replies."""

    replies: list[worker_pb2.TokenGenerateResponse]

    @property
    def token_ids(self) -> list[int]:
        return [t for r in self.replies for t in r.token_ids]

    @property
    def prefilled_remotely(self) -> bool:
        return self.replies[0].prefilled_remotely


async def generate(address: str, request_id: str, token_ids: list[int], max_tokens: int,
                   prefill_peers: Sequence[tuple[str, str]] = ()) -> Generated:
    """Greedy `max_tokens` tokens (EOS ignored) for `token_ids` from the worker at `address`.

    `prefill_peers` are (worker id, address) pairs: the first is the request's prefill
    peer, the rest its alternates (tried in order when one fails)."""
    peers = [worker_pb2.PrefillPeer(worker_id=name, address=peer) for name, peer in prefill_peers]
    request = worker_pb2.TokenGenerateRequest(
        request_id=request_id, token_ids=token_ids,
        params=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        prefill_peer=peers[0] if peers else None, alternate_prefill_peers=peers[1:])
    async with grpc.aio.insecure_channel(address) as channel:
        return Generated([r async for r in worker_pb2_grpc.WorkerStub(channel).Generate(request)])
