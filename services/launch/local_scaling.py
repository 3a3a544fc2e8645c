"""`serve --autoscale`: the planner's counts applied to local worker processes (the shared
loop's `ScaleActuator`, services/autoscaling; autoscale_thread.py runs the loop).

- `read_replicas`: what the autoscaler has asked for: the latest decision's counts, workers
  still waiting for a place included; before any decision, the workers starting and serving,
  not those draining.
- `apply`: a pool below its count starts workers (the same command line as serve's first
  workers, `worker_argv`, on a new port, named on from the last one: worker-2, worker-3, ...);
  a pool above it drains workers (`choose_to_drain`: a starting one first, else the least
  loaded in the latest reading, the newest on a tie): `Supervisor.retire` stops supervising
  the worker and sends it SIGTERM, on which it drains (services/worker/shutdown.py) and exits.
- `housekeeping`, between intervals (every autoscale_thread.HOUSEKEEPING_S): a started worker
  turning SERVING (how long it took refines the profile's start-up time; one not SERVING
  within --ready-timeout is stopped), a drained worker's exit, a mode switch's next step.

How the frontends follow: through the local etcd (membership.py). A started worker
registers itself once SERVING, and the frontends route to it from then on; a draining one
is NOT_SERVING at once (the frontends' health watches stop routing new requests to it),
finishes its running requests, then deregisters and exits, and the frontends drop it.

Mode (`--autoscale-mode`): `auto` lets the planner switch between aggregated and
disaggregated serving (it does when the other mode meets the SLO where this one cannot, or
needs fewer workers, over a whole cool-down window: planner.py); `fixed` keeps the mode serve
started in. In `auto` every worker that decodes runs as a decode process (plan.process_role),
so a switch moves the decoding workers to the new mode's pool in place: aggregated -> decode
keeps all of them (a surplus drains, freeing places for prefill workers), decode ->
aggregated keeps them and replaces the prefill workers. Workers that cannot serve in the new
mode (prefill workers, aggregated processes of a `fixed` start) are replaced one place at a
time, never leaving the frontends without a worker that can decode (`_converge`, every
housekeeping): the new mode's workers start in free places; while places are missing, an
old-mode worker drains to free one (a prefill worker first; one that decodes only while
another decode-capable worker serves); once every new-mode worker serves, the old-mode ones
left drain. Meanwhile the frontends route over both kinds (a decode or aggregated worker
routed a prefill peer it cannot use prefills locally), and the planner's samples count only
the new mode's workers.
Pools: 1 to --max-workers workers (disaggregated: each pool 1 to --max-workers - 1, both
within --max-workers). A worker needs a free place (plan.worker_slots): a draining worker
holds its place (its cores) until it exits.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.net import free_port
from splitserve.services.launch.topology import AutoscaleSettings, process_role
from splitserve.services.launch.probes import worker_serving
from splitserve.services.launch.supervisor import Child, Supervisor
from splitserve.services.planner import Decision, ReplicaCounts
from splitserve.services.planner.readings import DrainCandidate, Reading, choose_several, replica_counts
from splitserve.tls import PLAINTEXT, TlsConfig

ROLE_OF_POOL = {"aggregated": "both", "prefill": "prefill", "decode": "decode"}
STARTING, SERVING, DRAINING = "starting", "serving", "draining"


@dataclass(slots=True)
class ScaledWorker:
    name: str
    index: int                  # from its name: worker-3 -> 3
    role: str                   # its pool's: both | prefill | decode
    slot: int                   # its place (cores) among plan.worker_slots
    child: Child
    state: str = SERVING        # starting | serving | draining
    changed_at: float = 0.0     # when it entered its state (monotonic)
    process_role: str = ""      # the role its process started in, where not `role` (plan.process_role)

    def can_serve_as(self, role: str) -> bool:
        """A decode process serves in the aggregated pool too (plan.process_role)."""
        started = self.process_role or self.role
        return role == started or (started == "decode" and role == "both")

    @property
    def address(self) -> str:
        return self.child.address


@dataclass(slots=True)
class WorkerLauncher:
    """Starts one more worker the way serve starts its first ones."""

    sup: Supervisor
    argv: Callable[[str, str, int, str | None], list[str]]   # (name, role, port, cores) -> the command line
    slot_cores: list[str | None]                              # per place

    def start(self, name: str, role: str, slot: int) -> Child:
        port = free_port("127.0.0.1")
        return self.sup.spawn(name, self.argv(name, role, port, self.slot_cores[slot]), f"127.0.0.1:{port}",
                              starting=True)


class LocalWorkers:
    """serve's workers under the autoscaler: `ScaleActuator` (module header)."""

    def __init__(self, sup: Supervisor, say: Callable[[str], None], settings: AutoscaleSettings, aggregated: bool,
                 launcher: WorkerLauncher, workers: list[ScaledWorker], tls: TlsConfig = PLAINTEXT,
                 last_reading: Callable[[], Reading | None] = lambda: None):
        self.sup, self.say, self.settings, self.aggregated = sup, say, settings, aggregated
        self.launcher = launcher
        self.workers = list(workers)
        self.tls = tls
        self.last_reading = last_reading              # the source's latest reading: each worker's load, to drain
        self.target: ReplicaCounts | None = None      # the counts the latest decision asked for
        self._next_index = {role: max((w.index for w in workers if w.role == role), default=-1) + 1
                            for role in ROLE_OF_POOL.values()}

    def serving(self) -> list[tuple[str, str]]:
        """(role, address) of the workers SERVING: those whose Stats a reading takes."""
        return [(w.role, w.address) for w in self.workers if w.state == SERVING]

    # -- between intervals -------------------------------------------------------------
    def housekeeping(self, now: float | None = None) -> list[float]:
        """Started workers that turned SERVING (or never do: stopped after the supervisor's start
        timeout, --ready-timeout), drained workers that exited, a mode switch's next step. The
        start-up times of the workers that turned SERVING (the profile learns them)."""
        ready = []
        for w in [w for w in self.workers if w.state == STARTING]:
            if worker_serving(w.address, self.tls):
                t = time.monotonic() if now is None else now
                took = t - w.changed_at
                w.state, w.changed_at = SERVING, t
                ready.append(took)
                self.say(f"autoscale: {w.name} ready after {took:.1f} s at {w.address}; the frontends route to it")
            elif (t := time.monotonic() if now is None else now) - w.changed_at > self.sup.start_timeout_s:
                w.state, w.changed_at = DRAINING, t
                self.sup.retire(w.child)
                self.say(f"autoscale: {w.name} is not serving {self.sup.start_timeout_s:.0f} s after its start; "
                         f"stopping it (the next interval may start another)")
        gone = {id(c): c for c in self.sup.reap_retired(now)}
        for w in [w for w in self.workers if id(w.child) in gone]:
            self.workers.remove(w)
            took = (time.monotonic() if now is None else now) - w.changed_at
            self.say(f"autoscale: {w.name} drained and stopped after {took:.1f} s "
                     f"(exit code {w.child.process.returncode})")
        self._converge()
        return ready

    # -- the counts --------------------------------------------------------------------
    def asked(self) -> ReplicaCounts:
        """What the autoscaler has asked for (the planner's `sample.replicas`): the latest
        decision's counts, workers still waiting for a place included; before any decision,
        the workers running. In a switch the running count of the new mode is 0 at first,
        which the planner would read as a deployment to start from nothing."""
        return self.target if self.target is not None else self._running()

    async def read_replicas(self) -> ReplicaCounts:
        return self.asked()

    def _running(self) -> ReplicaCounts:
        """The workers of the current mode not draining, starting ones included."""
        roles: dict[str, int] = {}
        for w in self.workers:
            if w.state != DRAINING:
                roles[w.role] = roles.get(w.role, 0) + 1
        return replica_counts(self.aggregated, roles)

    # -- applying a decision -----------------------------------------------------------
    async def apply(self, decision: Decision) -> None:
        """Start, drain and move workers toward `decision.replicas` (module header); what finds no
        place yet starts in a later housekeeping. Nothing here awaits: it runs on the thread."""
        self.target = decision.replicas
        aggregated = not decision.replicas.disaggregated
        if aggregated != self.aggregated:
            self.aggregated = aggregated
            moved = self._move_to_new_mode()
            kept = (f"{', '.join(w.name for w in moved)} now serve{'s' if len(moved) == 1 else ''} in the "
                    f"{'aggregated' if aggregated else 'decode'} pool in place; " if moved else "")
            self.say(f"autoscale: switching to {'aggregated' if aggregated else 'disaggregated'} serving: {kept}"
                     f"{len(self._foreign())} worker(s) replaced one place at a time, no request lost")
        running = self._running()
        for pool in self._pools():      # shrink first: a draining worker's place frees sooner
            surplus = running.count(pool) - decision.replicas.count(pool)
            if surplus > 0:
                self._drain(ROLE_OF_POOL[pool], surplus)
        self._converge()
        waiting = len(self._missing_roles())
        if waiting and not self._foreign():
            self.say(f"autoscale: no free place for {waiting} more worker(s) yet (--max-workers "
                     f"{self.settings.max_workers}, draining workers still hold theirs); they start as places free")

    def _move_to_new_mode(self) -> list[ScaledWorker]:
        """In a switch, the workers that decode and can serve in the new mode's decoding pool move to it."""
        role = "both" if self.aggregated else "decode"
        moved = [w for w in self.workers if w.state != DRAINING and w.role != role and w.can_serve_as(role)]
        for w in moved:
            w.role = role
        return moved

    def _foreign(self) -> list[ScaledWorker]:
        """Workers of the mode a switch left, not draining yet."""
        roles = self._roles()
        return [w for w in self.workers if w.state != DRAINING and w.role not in roles]

    def _pools(self) -> tuple[str, ...]:
        return ("aggregated",) if self.aggregated else ("decode", "prefill")

    def _roles(self) -> set[str]:
        return {ROLE_OF_POOL[p] for p in self._pools()}

    def _missing_roles(self) -> list[str]:
        """The roles of the workers the target still lacks, decode-capable ones first."""
        if self.target is None:
            return []
        running = self._running()
        return [ROLE_OF_POOL[pool] for pool in self._pools()
                for _ in range(max(0, self.target.count(pool) - running.count(pool)))]

    def _converge(self) -> None:
        """Start what the target lacks where places are free (a start an interval deferred, a mode
        switch's next worker); in a switch (module header), drain an old-mode worker while places
        are still missing, and the rest once the new mode's workers serve."""
        missing = self._missing_roles()
        free = len(self.launcher.slot_cores) - len(self.workers)
        for role in missing[:max(0, free)]:     # also a start an earlier interval found no place for
            self._start(role)
        missing = missing[max(0, free):]
        foreign = self._foreign()
        if not foreign:
            return
        roles = self._roles()
        if missing and not any(w.state == DRAINING for w in self.workers):    # one place at a time
            pick = self._foreign_to_drain(foreign)
            if pick is not None:
                self._retire(pick, "to free a place for the new mode's workers")
        elif not missing and all(w.state == SERVING for w in self.workers if w.role in roles and w.state != DRAINING):
            for w in foreign:
                self._retire(w, "the new mode's workers serve")

    def _foreign_to_drain(self, foreign: list[ScaledWorker]) -> ScaledWorker | None:
        """An old-mode prefill worker, else one that decodes while another decode-capable worker serves."""
        prefill = [w for w in foreign if w.role == "prefill"]
        if prefill:
            return prefill[-1]
        decoding = [w for w in self.workers if w.state == SERVING and w.role != "prefill"]
        for w in reversed(foreign):
            if any(x is not w for x in decoding):
                return w
        return None

    def _retire(self, w: ScaledWorker, why: str) -> None:
        what = "stopping it (it was still starting)" if w.state == STARTING else \
            "draining it: no new requests, running ones finish"
        w.state, w.changed_at = DRAINING, time.monotonic()
        self.sup.retire(w.child)
        self.say(f"autoscale: {w.name} ({w.role}) leaves, {why}; {what}")

    def _start(self, role: str) -> ScaledWorker | None:
        taken = {w.slot for w in self.workers}
        free = [s for s in range(len(self.launcher.slot_cores)) if s not in taken]
        if not free:
            self.say(f"autoscale: no free place for another {role} worker yet (--max-workers "
                     f"{self.settings.max_workers}, draining workers still hold theirs)")
            return None
        index = self._next_index[role]
        self._next_index[role] += 1
        name = f"{'worker' if role == 'both' else role}-{index}"
        started_as = process_role(role, self.settings)
        child = self.launcher.start(name, started_as, free[0])
        w = ScaledWorker(name, index, role, free[0], child, STARTING, time.monotonic(), started_as)
        self.workers.append(w)
        how = role if started_as == role else f"{role}, a {started_as} process"
        self.say(f"autoscale: starting {name} ({how}) at {child.address}")
        return w

    def _drain(self, role: str, count: int) -> None:
        reading = self.last_reading()
        load = {c.worker_id: c for c in (reading.workers if reading else ())}
        candidates = [DrainCandidate(w.name, w.index, w.state == STARTING,
                                     load[w.name].load if w.name in load else 0,
                                     load[w.name].kv_usage if w.name in load else 0.0)
                      for w in self.workers if w.role == role and w.state != DRAINING]
        for pick in choose_several(candidates, count):
            self._retire(next(x for x in self.workers if x.name == pick.name), f"{pick.load} requests on it")


def launcher_for(sup: Supervisor, args: argparse.Namespace, python: list[str], model: str,
                 slot_cores: list[str | None], kv_store: str | None, etcd: str) -> WorkerLauncher:
    from splitserve.services.launch.children import worker_argv

    def argv(name: str, role: str, port: int, cores: str | None) -> list[str]:
        return [*python, *worker_argv(args, name, role, port, model, cores, kv_store, etcd)]

    return WorkerLauncher(sup, argv, slot_cores)
