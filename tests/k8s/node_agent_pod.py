"""One pod on the test node agent: its processes, probes, restarts, status, deletion.

Test infrastructure, part of the stand-in for kubelet + container runtime
(node_agent.py). A `PodSupervisor` owns one pod from binding to removal, on
one thread of its own: it starts each container as a host process inside the
pod's network namespace (`ip netns exec`, which execs, so the pid is the
container's) and a UTS namespace of its own (hostname = the pod's), runs its
probes, restarts it per `restartPolicy`, and posts the
pod's status (phase, podIP, conditions, containerStatuses) whenever it changes.
On deletion it sends SIGTERM to each container's process group, waits the
grace period, sends SIGKILL, and then finishes the deletion with grace 0 (uid
precondition), as kubelet does.

Why one thread per pod and not asyncio: the processes get PR_SET_PDEATHSIG
(a killed test run leaves no orphans), and the kernel ties that signal to the
*thread* that forked — so the thread that starts a container must live as long
as the container; the official client is synchronous anyway.
Restart back-off is kubelet's shape (doubling) at test speed: 0.5 s up to 5 s.
Volumes: node_agent_volumes.py (written once, at the first container start;
bind-mounted in each container's mount namespace). Init containers and
resource limits are not implemented.
"""

from __future__ import annotations

import ctypes
import logging
import datetime as dt
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from node_agent_probes import ProbeState, run_probe
from node_agent_spec import EnvResolutionError, Lookup, Probe, container_argv, resolve_env
from node_agent_volumes import TokenSource, container_mounts, materialize, mount_steps, python_environment

log = logging.getLogger("node_agent")
BACKOFF_FIRST, BACKOFF_MAX = 0.5, 5.0
TICK = 0.1


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG


@dataclass(slots=True)
class ContainerRun:
    """A container of the pod: the current process and what kubelet reports of it."""

    spec: dict[str, Any]
    log_path: Path
    popen: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)
    restart_count: int = 0
    started_at: str = ""
    next_start: float = 0.0           # monotonic time of the next (re)start
    backoff: float = BACKOFF_FIRST
    terminated: dict[str, Any] | None = None   # the last exit, kubelet's `terminated` state
    waiting_reason: str = "ContainerCreating"
    done: bool = False                # exited and will not be restarted
    awaiting_restart: bool = False    # exited, to be restarted at next_start
    startup: ProbeState | None = None
    readiness: ProbeState | None = None
    liveness: ProbeState | None = None

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def started(self) -> bool:
        return self.running and (self.startup is None or self.startup.passed)

    @property
    def ready(self) -> bool:
        return self.started and (self.readiness is None or self.readiness.passed)

    def state(self) -> dict[str, Any]:
        blank = {"running": None, "waiting": None, "terminated": None}
        if self.running:
            return {**blank, "running": {"startedAt": self.started_at}}
        if self.done and self.terminated:
            return {**blank, "terminated": self.terminated}
        return {**blank, "waiting": {"reason": self.waiting_reason}}

    def status(self) -> dict[str, Any]:
        out = {"name": self.name, "image": self.spec.get("image", ""), "imageID": "",
               "containerID": f"splitserve-node-agent://{self.popen.pid}" if self.popen else "",
               "ready": self.ready, "started": self.started, "restartCount": self.restart_count,
               "state": self.state()}
        if self.terminated and not self.done:
            out["lastState"] = {"terminated": self.terminated}
        return out


def stop_process(popen: subprocess.Popen, grace: float) -> int:
    """SIGTERM the process group, SIGKILL after `grace` seconds; the exit status."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(popen.pid, sig)
        except ProcessLookupError:
            break
        try:
            return popen.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    return popen.wait(10)


@dataclass
class PodSupervisor:
    """Runs one pod until it is deleted (see the module docstring)."""

    pod: dict[str, Any]
    netns: str
    pod_ip: str
    host_ip: str
    workdir: Path
    lookup: Lookup
    post_status: Callable[[dict[str, Any], dict[str, Any]], None]   # (pod, status patch)
    finish_deletion: Callable[[dict[str, Any]], None]
    on_finished: Callable[[PodSupervisor], None]            # the thread's last act, unless it crashed
    on_crash: Callable[[PodSupervisor, str], None]          # a bug in the agent: the pod stays stuck
    base_env: dict[str, str]
    image_env: dict[str, dict[str, str]]                    # image -> env over base_env
    entrypoints: dict[str, tuple[str, ...]]
    token: TokenSource
    service_env: dict[str, str] = field(default_factory=dict)   # KUBERNETES_SERVICE_HOST/PORT, as kubelet sets
    containers: list[ContainerRun] = field(default_factory=list)
    volumes: dict[str, Path] | None = None  # volume name -> its folder, once written
    deletion_grace: float | None = None     # set when the pod is being deleted
    force_gone: bool = False                # the object is already gone from the apiserver
    _wake: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _last_status: dict[str, Any] | None = None
    _start_time: str = field(default_factory=now_iso)
    _transitions: dict[str, tuple[str, str]] = field(default_factory=dict)   # type -> (status, since)

    @property
    def key(self) -> str:
        return f"{self.pod['metadata']['namespace']}/{self.pod['metadata']['name']}"

    @property
    def ready(self) -> bool:
        return bool(self.containers) and all(c.ready for c in self.containers)

    @property
    def restart_policy(self) -> str:
        return self.pod["spec"].get("restartPolicy", "Always")

    def start(self) -> None:
        log.info("%s: admitted (pod IP %s)", self.key, self.pod_ip)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pod.setdefault("status", {})["podIP"] = self.pod_ip
        self.pod["status"]["hostIP"] = self.host_ip
        self.containers = [ContainerRun(c, self.workdir / f"{c['name']}.log") for c in self.pod["spec"]["containers"]]
        self._thread = threading.Thread(target=self._run, name=f"pod-{self.key}", daemon=True)
        self._thread.start()

    def request_deletion(self, grace: float | None, gone: bool = False) -> None:
        default = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
        self.deletion_grace = default if grace is None else grace
        self.force_gone = self.force_gone or gone
        self._wake.set()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the pod's thread ----------------------------------------------------------

    def _run(self) -> None:
        try:
            while self.deletion_grace is None:
                now = time.monotonic()
                for c in self.containers:
                    self._step(c, now)
                self._report()
                self._wake.wait(TICK)
            self._terminate_all(self.deletion_grace)
            if not self.force_gone:
                self.finish_deletion(self.pod)
        except Exception:  # a crashed supervisor must not take down the agent: report it, stay stuck
            for c in self.containers:
                if c.running:
                    stop_process(c.popen, 0)
            self.on_crash(self, traceback.format_exc())
            return
        self.on_finished(self)

    def _step(self, c: ContainerRun, now: float) -> None:
        if c.done:
            return
        if c.popen is None or c.awaiting_restart:
            if now >= c.next_start:
                self._start_container(c, now)
            return
        code = c.popen.poll()
        if code is not None:
            self._on_exit(c, code, now)
            return
        self._probe(c, now)

    def _start_container(self, c: ContainerRun, now: float) -> None:
        try:
            env = resolve_env(self.pod, c.spec, self.lookup)
            if self.volumes is None:
                self.volumes = materialize(self.pod, self.workdir / "volumes", self.lookup, self.token)
            mounts = container_mounts(c.spec, self.volumes)
        except EnvResolutionError as e:
            c.waiting_reason = "CreateContainerConfigError"
            c.next_start = now + 1.0
            (self.workdir / f"{c.name}.error").write_text(str(e))
            return
        c.env = {**self.base_env, **self.image_env.get(c.spec.get("image", ""), {}),
                 "HOSTNAME": self.pod["metadata"]["name"], **self.service_env, **env}
        argv = container_argv(c.spec, c.env, self.entrypoints)
        program = shutil.which(argv[0], path=c.env.get("PATH")) or argv[0]
        cwd = c.spec.get("workingDir")
        if not (cwd and Path(cwd).is_dir()):
            cwd = str(self.workdir)
        if c.popen is not None:
            c.restart_count += 1
        c.awaiting_restart = False
        with open(c.log_path, "ab") as log_file:
            c.popen = subprocess.Popen(["ip", "netns", "exec", self.netns, *self._wrapper(mounts), program, *argv[1:]],
                                       env=c.env,
                                       cwd=cwd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True, preexec_fn=_die_with_parent)
        c.started_at = now_iso()
        log.info("%s: started container %s (pid %d, restart %d)", self.key, c.name, c.popen.pid, c.restart_count)
        spec = c.spec
        c.startup = ProbeState.begin(Probe.from_spec(spec.get("startupProbe")), now)
        c.readiness = ProbeState.begin(Probe.from_spec(spec.get("readinessProbe")), now)
        c.liveness = ProbeState.begin(Probe.from_spec(spec.get("livenessProbe")), now)

    def _wrapper(self, mounts) -> list[str]:
        """argv prefix: a UTS namespace whose hostname is the pod's (as a runtime gives every
        container: gloo, for one, binds to the address its hostname resolves to), the volume
        mounts, then exec the container's command (the pid stays the container's)."""
        hostname = self.pod["spec"].get("hostname") or self.pod["metadata"]["name"]
        steps = [f"hostname {shlex.quote(hostname)}", *mount_steps(mounts, python_environment())]
        return ["unshare", "--uts", "sh", "-ec", " && ".join(steps) + ' && exec "$@"', "sh"]

    def _on_exit(self, c: ContainerRun, code: int, now: float, reason: str | None = None) -> None:
        exit_code = 128 - code if code < 0 else code          # killed by signal N: 128+N
        c.terminated = {"exitCode": exit_code, "reason": reason or ("Completed" if exit_code == 0 else "Error"),
                        "startedAt": c.started_at, "finishedAt": now_iso(), "containerID": f"splitserve-node-agent://{c.popen.pid}"}
        policy = self.restart_policy
        if policy == "Never" or (policy == "OnFailure" and exit_code == 0):
            c.done = True
            return
        c.awaiting_restart = True
        c.waiting_reason = "CrashLoopBackOff"
        c.next_start = now + c.backoff
        c.backoff = min(c.backoff * 2, BACKOFF_MAX)

    def _probe(self, c: ContainerRun, now: float) -> None:
        active = [c.startup] if c.startup is not None and not c.startup.passed else [c.liveness, c.readiness]
        for state in active:
            if state is None or not state.due(now):
                continue
            ok = run_probe(state.probe, self.netns, self.pod_ip, c.spec, c.env)
            log.debug("%s: %s probe of %s: %s", self.key, state.probe.kind, c.name, "pass" if ok else "fail")
            state.record(ok, time.monotonic())
            if state.failed and state is not c.readiness:
                # Startup or liveness failed: kubelet kills the container and restarts it per policy.
                grace = state.probe.termination_grace
                if grace is None:
                    grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
                code = stop_process(c.popen, grace)
                self._on_exit(c, code, time.monotonic(), reason="Error")
                return

    def _terminate_all(self, grace: float) -> None:
        for c in self.containers:
            if c.running:
                code = stop_process(c.popen, grace)
                self._on_exit(c, code, time.monotonic())
            c.done = True
        if not self.force_gone:
            self._report()

    # ---- status --------------------------------------------------------------------

    def _phase(self) -> str:
        if any(c.running for c in self.containers):
            return "Running"
        if all(c.done for c in self.containers):
            failed = any((c.terminated or {}).get("exitCode", 1) != 0 for c in self.containers)
            return "Failed" if failed else "Succeeded"
        if any(c.restart_count or c.terminated for c in self.containers):
            return "Running"                  # between restarts, as kubelet reports it
        return "Pending"

    def _report(self) -> None:
        ready = all(c.ready for c in self.containers)
        conds = {"PodReadyToStartContainers": True, "Initialized": True, "ContainersReady": ready, "Ready": ready}
        statuses = [c.status() for c in self.containers]
        body = {"phase": self._phase(), "podIP": self.pod_ip, "podIPs": [{"ip": self.pod_ip}],
                "hostIP": self.host_ip, "hostIPs": [{"ip": self.host_ip}], "startTime": self._start_time,
                "conditions": [{"type": t, "status": "True" if v else "False"} for t, v in conds.items()],
                "containerStatuses": statuses}
        if body == self._last_status:
            return
        for cond in body["conditions"]:   # a condition's transition time changes only when its status does
            prev = self._transitions.get(cond["type"])
            if prev is None or prev[0] != cond["status"]:
                self._transitions[cond["type"]] = (cond["status"], now_iso())
        stamped = {**body, "conditions": [{**cond, "lastTransitionTime": self._transitions[cond["type"]][1]}
                                          for cond in body["conditions"]]}
        log.info("%s: status %s ready=%s", self.key, body["phase"], ready)
        self.post_status(self.pod, stamped)
        self._last_status = body
