"""Graceful worker shutdown (SIGTERM): stop admission, let running calls finish, deregister.

The order matters:
1. health turns NOT_SERVING and new Generate/Prefill calls are refused with UNAVAILABLE,
   so frontends stop routing here (a call that raced in is retried elsewhere by the
   frontend's migration);
2. running calls get up to the drain timeout to finish; a frontend keeps its channel
   open meanwhile, so they finish here instead of being migrated;
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


@dataclass(slots=True, frozen=True)
class DrainResult:
    num_left: int            # calls still running at the deadline (they are failed next)
    took_s: float


async def drain(service: WorkerService, timeout_s: float, registration=None) -> DrainResult:
    """The steps above; the caller stops the server afterwards."""
    start = time.monotonic()
    wid = service.options.worker_id
    await service.start_draining()
    log.info("worker %s: draining: %d calls running, waiting up to %.1f s", wid,
             service.counters.num_in_flight, timeout_s)
    while service.counters.num_in_flight and time.monotonic() - start < timeout_s:
        await asyncio.sleep(POLL_S)
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
    if not left:
        log.info("worker %s: drained in %.2f s", wid, took)
    return DrainResult(left, took)
