"""Graceful worker shutdown (SIGTERM): stop admission, let running calls finish, deregister.

The order matters:
1. health turns NOT_SERVING and new Generate/Prefill calls are refused with UNAVAILABLE,
   so frontends stop routing here (a call that raced in is retried elsewhere by the
   frontend's migration);
2. running calls get up to the drain timeout to finish; a frontend keeps its channel
   open meanwhile, so they finish here instead of being migrated. A prefill worker also
   waits until no finished prefill's KV is still held for its decode worker (vLLM's
   NixlConnector: the decode worker pulls it after the Prefill call returned), so leaving
   never makes a decode worker recompute a prompt that was already computed here; and a decode
   worker waits until the requests it suspended for a live migration (frontends move a draining
   decode worker's requests away with their KV) had their KV read;
3. whatever still runs at the deadline is failed with UNAVAILABLE ("shutting down"),
   which a frontend answers by migrating the request to another decode worker;
4. the etcd registration is revoked only then (a router that discovers workers through
   etcd drops the worker and closes its channel, which would cut running streams short).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from splitserve.services.worker.service import WorkerService

log = logging.getLogger(__name__)

POLL_S = 0.05
FAIL_GRACE_S = 2.0       # for the failed calls' statuses to reach their callers
STATS_TIMEOUT_S = 1.0    # one engine step at most: the engine thread answers between steps


@dataclass(slots=True, frozen=True)
class DrainResult:
    num_left: int            # calls still running at the deadline (they are failed next)
    took_s: float


async def drain(service: WorkerService, timeout_s: float, registration=None) -> DrainResult:
    """The steps above; the caller stops the server afterwards."""
    start = time.monotonic()
    wid = service.options.worker_id
    await service.start_draining()
    log.info("worker %s: draining: %s, waiting up to %.1f s", wid, await _busy(service) or "idle", timeout_s)
    while (busy := await _busy(service)) and time.monotonic() - start < timeout_s:
        await asyncio.sleep(POLL_S)
    if busy and not service.counters.num_in_flight:
        log.warning("worker %s: %s after the %.1f s drain timeout; their decode workers recompute them",
                    wid, busy, timeout_s)
    left = service.counters.num_in_flight
    if left and service.loop is not None:
        log.warning("worker %s: %d calls still running after the %.1f s drain timeout; failing them so "
                    "their frontends migrate them", wid, left, timeout_s)
        await asyncio.to_thread(service.loop.stop)      # every open stream fails with UNAVAILABLE
        end = time.monotonic() + FAIL_GRACE_S
        while service.counters.num_in_flight and time.monotonic() < end:
            await asyncio.sleep(POLL_S)
    if registration is not None:
        await registration.close()
        log.info("worker %s: deregistered", wid)
    took = time.monotonic() - start
    if not busy:
        log.info("worker %s: drained in %.2f s", wid, took)
    return DrainResult(left, took)


async def _busy(service: WorkerService) -> str:
    """What the worker still does that leaving would cut short; "" when nothing."""
    if service.counters.num_in_flight:
        return f"{service.counters.num_in_flight} calls running"
    stats = await service.read_stats(STATS_TIMEOUT_S)
    if stats is not None and stats.num_held_prefills:
        return f"{stats.num_held_prefills} prefills' KV not yet taken by their decode workers"
    if stats is not None and stats.num_suspended_held:
        return f"{stats.num_suspended_held} suspended requests' KV not yet read by the decode workers taking them over"
    return ""
